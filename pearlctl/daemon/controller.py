"""What the daemon knows about agents and workers, and the desired state it hands back.

Agents register once per process (``register``) and then heartbeat (``heartbeat``) with the workers
they actually run. The controller records that truth in state, answers with the workers the
allocation should run (derived from its GPUs' roles), and marks an agent's GPUs and workers LOST when
its heartbeats stop for ``lost_after`` heartbeat intervals. Every write carries the daemon's lease
epoch, so a deposed daemon cannot write; every answer carries it, so agents can ignore an older one.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import threading
import time
from dataclasses import dataclass, fields

from pearlctl.daemon.borrowing import PolicyError, load_policy
from pearlctl.daemon.effects import pending_trainer_command, record_trainer_ack
from pearlctl.planner import profile as profiles
from pearlctl.planner.model import Work
from pearlctl.state.machines import MACHINES
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.store import Store

# Which engine serves which role.
ENGINE_FOR_ROLE = {"TRAIN": "deepspeed", "ROLLOUT": "vllm", "PREFILL": "vllm", "DECODE": "vllm", "REWARD": "vllm"}


def _work_fields(work) -> dict:
    """The ``work`` of a progress report: Work's numeric fields only, each a finite number >= 0."""
    known = {f.name for f in fields(Work)}
    if not isinstance(work, dict) or set(work) - known:
        extra = sorted(set(work) - known) if isinstance(work, dict) else work
        raise ControlError(f"work: unknown field(s) {extra}; known: {', '.join(sorted(known))}")
    for k, v in work.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ControlError(f"work.{k} must be a finite number >= 0, got {v!r}")
    return dict(work)


class ControlError(Exception):
    """A request the controller refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def edge_path(table: str, old: str, new: str) -> list[str]:
    """The shortest chain of legal states from ``old`` to ``new`` (excluding ``old``); [] if none."""
    edges = MACHINES[table].edges
    queue = collections.deque([(old, [])])
    seen = {old}
    while queue:
        state, path = queue.popleft()
        for a, b in edges:
            if a == state and b not in seen:
                if b == new:
                    return [*path, b]
                seen.add(b)
                queue.append((b, [*path, b]))
    return []


def desired_hash(desired: list[dict]) -> str:
    return hashlib.sha256(json.dumps(desired, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DesiredWorker:
    key: str  # stable per allocation: "<role>-<first gpu>"
    role: str
    engine: str
    gpus: tuple[int, ...]
    state: str  # "RUNNING" | "SLEEPING" | "STOPPED"

    weights: dict | None = None  # vLLM workers: the trainer's latest export to serve {version, path}

    def as_dict(self) -> dict:
        return {
            "weights": self.weights,
            "key": self.key,
            "role": self.role,
            "engine": self.engine,
            "gpus": list(self.gpus),
            "state": self.state,
        }


class Controller:
    def __init__(
        self,
        store: Store,
        run_id: str,
        epoch: int,
        *,
        heartbeat_s: float = 2.0,
        lost_after: float = 2.0,
        clock=time.time,
    ):
        self.store, self.run_id, self.epoch = store, run_id, epoch
        self.heartbeat_s, self.lost_after, self.clock = heartbeat_s, lost_after, clock
        self.borrowing = None  # set by the daemon: pearlctl.daemon.borrowing.Borrowing
        self.changed = threading.Condition()  # notified when desired state may have changed (long polls)
        self.wake = threading.Event()  # set when a report may let the control loop make progress
        self.polling: collections.Counter[int] = collections.Counter()  # allocation -> heartbeats held now
        self.started_at = clock()
        # one decision at a time: HTTP threads and the control loop share state (reentrant: borrow() plans)
        self.lock = threading.RLock()

    # -- agents -----------------------------------------------------------------------------------
    def _allocation(self, job_id: str, task_id: int) -> dict:
        for a in self.store.allocations(self.run_id):
            if a["job_id"] == str(job_id) and a["array_index"] == int(task_id):
                return a
        raise ControlError(f"run {self.run_id} has no allocation for job {job_id} task {task_id}", 404)

    def register(self, body: dict) -> dict:
        """An agent starts (or restarts): bind it to its allocation and its GPUs."""
        with self.lock:
            alloc = self._allocation(body["job_id"], body["task_id"])
            if alloc["state"] in (A.ENDED, A.REQUESTED):
                raise ControlError(f"allocation {alloc['id']} is {alloc['state']}: not accepting agents", 409)
            gpus = [int(g) for g in body.get("gpus", [])]
            pool = self._pool_of(alloc)
            if not gpus and pool["gpus_per_node"]:
                gpus = list(range(pool["gpus_per_node"]))  # no device list in the environment (local backend)
            self.store.update_fields(
                "allocations",
                alloc["id"],
                epoch=self.epoch,
                event="agent registered",
                data={"pid": body.get("pid"), "node": body.get("node"), "gpus": gpus},
                agent_pid=body.get("pid"),
                agent_seen_at=self.clock(),
            )
            if body.get("node"):
                self.store.upsert_node_gpus(
                    self.run_id, alloc["id"], body["node"], gpus, pool["role"], epoch=self.epoch
                )
            return {"allocation_id": alloc["id"], "epoch": self.epoch, "heartbeat_s": self.heartbeat_s}

    def heartbeat(self, body: dict) -> dict:
        """Record what the agent runs; answer with what it should run.

        Long poll: an agent that sends the ``desired_hash`` of its last answer and ``wait_s`` is held
        until its desired workers change (or ``wait_s``, at most one heartbeat interval, passes), so a
        transition's effect reaches the agent in milliseconds, not a heartbeat later.
        """
        alloc_id = int(body["allocation_id"])
        with self.lock:
            alloc = self.store.get("allocations", alloc_id)
            if alloc["run_id"] != self.run_id:
                raise ControlError(f"allocation {alloc_id} is not in run {self.run_id}", 404)
            self.store.update_fields("allocations", alloc_id, epoch=self.epoch, agent_seen_at=self.clock())
            changed = [self._record_worker(alloc, report) for report in body.get("workers", [])]
            if body.get("leaving"):
                # The agent is going away (scancel, end of the allocation): its GPUs are not plannable any
                # more from this moment, whatever Slurm says a poll later.
                self._mark_gpus_lost(alloc_id, "agent leaving")
                self.wake.set()
                return {"epoch": self.epoch, "desired": [], "heartbeat_s": self.heartbeat_s}
            self._revive_gpus(alloc_id)
            desired = [w.as_dict() for w in self.desired(alloc_id)]
        if any(changed):
            self.wake.set()  # a worker moved: a transition step may complete now
        digest = desired_hash(desired)
        wait = min(float(body.get("wait_s") or 0.0), self.heartbeat_s)
        if wait > 0 and body.get("desired_hash") == digest:
            deadline = time.monotonic() + wait
            self.polling[alloc_id] += 1  # held here: the agent is alive even though it sends nothing new
            try:
                with self.changed:
                    while digest == body["desired_hash"] and (left := deadline - time.monotonic()) > 0:
                        self.changed.wait(left)
                        with self.lock:
                            desired = [w.as_dict() for w in self.desired(alloc_id)]
                        digest = desired_hash(desired)
            finally:
                self.polling[alloc_id] -= 1
        return {"epoch": self.epoch, "desired": desired, "desired_hash": digest, "heartbeat_s": self.heartbeat_s}

    def notify(self) -> None:
        """Desired state may have changed: wake every long-polling agent to look."""
        with self.changed:
            self.changed.notify_all()

    def _mark_gpus_lost(self, alloc_id: int, why: str, data: dict | None = None) -> bool:
        hit = False
        for g in self.store.gpus(self.run_id):
            if g["allocation_id"] == alloc_id and g["state"] in (G.UP, G.DRAINING):
                self.store.set_state(
                    "gpus", g["id"], expect=g["state"], to=G.LOST, epoch=self.epoch, event=why, data=data
                )
                hit = True
        return hit

    def _revive_gpus(self, alloc_id: int) -> None:
        for g in self.store.gpus(self.run_id):
            if g["allocation_id"] == alloc_id and g["state"] == G.LOST:
                self.store.set_state(
                    "gpus", g["id"], expect=G.LOST, to=G.UP, epoch=self.epoch, event="agent reporting again"
                )

    def _record_worker(self, alloc: dict, report: dict) -> bool:
        """Fold one reported worker into state: create it, move it along legal edges, keep its facts.
        Returns whether its state moved."""
        key, state = str(report["key"]), str(report["state"])
        fields = {k: report[k] for k in ("url", "pid", "weight_version") if report.get(k) is not None}
        worker = next(
            (
                w
                for w in self.store.workers(self.run_id)
                if w["allocation_id"] == alloc["id"] and w.get("worker_key") == key
            ),
            None,
        )
        if worker is not None and worker["state"] in (W.STOPPED, W.FAILED) and state not in (W.STOPPED, W.FAILED):
            # a new process under a key whose last one ended (a second borrow): archive the old row
            self.store.update_fields("workers", worker["id"], epoch=self.epoch, worker_key=f"{key}#{worker['id']}")
            worker = None
        created = worker is None
        if worker is None:
            if state in (W.STOPPED, W.FAILED):
                return False
            wid = self.store.add_worker(
                run_id=self.run_id,
                allocation_id=alloc["id"],
                role=report["role"],
                engine=report["engine"],
                epoch=self.epoch,
                **fields,
            )
            self.store.update_fields(
                "workers", wid, epoch=self.epoch, worker_key=key, gpu_idx=list(report.get("gpus", []))
            )
            worker = self.store.get("workers", wid)
        elif fields:
            self.store.update_fields("workers", worker["id"], epoch=self.epoch, **fields)
        current = worker["state"]
        moved = created or current != state
        if moved:
            path = edge_path("workers", current, state)
            if not path:
                self.store.journal_event(
                    self.run_id,
                    "workers",
                    str(worker["id"]),
                    "unexpected report",
                    data={"state": current, "reported": state},
                    epoch=self.epoch,
                )
            for step in path:
                self.store.set_state(
                    "workers",
                    worker["id"],
                    expect=current,
                    to=step,
                    epoch=self.epoch,
                    event="agent reported",
                    data={"reported": state},
                )
                current = step
        if report.get("engine") == "vllm" and self._pool_of(alloc)["name"] != "trainer":
            # a worker of a rollout/elastic/reward pool takes traffic while READY; one on borrowed trainer
            # GPUs only between its transition's REGISTER and DEREGISTER steps
            routable = int(current == W.READY)
            if routable != self.store.get("workers", worker["id"])["routable"]:
                self.store.update_fields("workers", worker["id"], epoch=self.epoch, routable=routable)
        return moved

    def _pool_of(self, alloc: dict) -> dict:
        return next(p for p in self.store.pools(self.run_id) if p["id"] == alloc["pool_id"])

    # -- desired state ----------------------------------------------------------------------------
    def desired(self, alloc_id: int) -> list[DesiredWorker]:
        """One worker per role among the allocation's live GPUs; none while the allocation is not RUNNING.

        A borrowed GPU serves ROLLOUT but still belongs to its trainer: the TRAIN worker keeps running
        (offloaded) across a borrow, so its key and GPU set do not change and it is never restarted. A vLLM
        worker parked on trainer GPUs after a return is desired asleep, ready to be woken by the next borrow.
        """
        alloc = self.store.get("allocations", alloc_id)
        if alloc["state"] not in (A.RUNNING,):
            return []
        by_role: dict[str, list[int]] = {}
        parked: dict[int, list[int]] = {}  # worker id -> GPUs where a returned vLLM worker sleeps
        for g in self.store.gpus(self.run_id):
            if g["allocation_id"] == alloc_id and g["state"] == G.UP:
                by_role.setdefault(g["role"], []).append(g["idx"])
                if g["borrowed"]:
                    by_role.setdefault("TRAIN", []).append(g["idx"])
                if g["worker_id"] is not None and g["role"] == "TRAIN":
                    parked.setdefault(g["worker_id"], []).append(g["idx"])
        trainer = self.store.get_run(self.run_id).get("trainer") or {}
        weights = None
        if trainer.get("weight_version") is not None and trainer.get("weights_path"):
            weights = {"version": str(trainer["weight_version"]), "path": trainer["weights_path"]}
        out = []
        for role, idx in sorted(by_role.items()):
            if role == "IDLE":
                continue
            out.append(
                DesiredWorker(
                    f"{role.lower()}-{min(idx)}",
                    role,
                    ENGINE_FOR_ROLE[role],
                    tuple(sorted(idx)),
                    "RUNNING",
                    weights if ENGINE_FOR_ROLE[role] == "vllm" else None,
                )
            )
        for wid, idx in sorted(parked.items()):
            w = self.store.get("workers", wid)
            if w["state"] not in (W.STOPPED, W.FAILED, W.LOST):  # a parked worker that died is simply gone
                out.append(DesiredWorker(w["worker_key"], w["role"], w["engine"], tuple(sorted(idx)), "SLEEPING"))
        return out

    # -- the trainer hook -------------------------------------------------------------------------
    def trainer_phase(self, body: dict) -> dict:
        """The trainer reports where it is; the answer is the command the current step asks for."""
        with self.lock:
            run = self.store.get_run(self.run_id)
            before = run.get("trainer") or {}
            now = self.clock()
            report = dict(body, reported_at=now)
            new_phase = (before.get("phase"), before.get("step")) != (body.get("phase"), body.get("step"))
            # the expected wait counts from when this wait began, not from each report of it
            report["phase_since"] = now if new_phase else before.get("phase_since", now)
            event = "trainer phase" if new_phase else None
            self.store.update_fields(
                "runs",
                self.run_id,
                epoch=self.epoch,
                event=event,
                data={"phase": body.get("phase"), "step": body.get("step")} if event else None,
                trainer=report,
            )
            # wake the control loop only for what a decision or a probe depends on, not for every poll
            watched = ("phase", "step", "released")
            if any(before.get(k) != body.get(k) for k in watched) or (body.get("blocked_s") is None) != (
                before.get("blocked_s") is None
            ):
                self.wake.set()
            return {"epoch": self.epoch, **pending_trainer_command(self.store, self.run_id)}

    def trainer_ack(self, body: dict) -> dict:
        with self.lock:
            found = record_trainer_ack(
                self.store, self.run_id, str(body["command_id"]), dict(body["result"]), self.epoch
            )
            if not found:
                raise ControlError(f"no step {body['command_id']!r} in run {self.run_id}", 404)
            self.wake.set()
            return {"epoch": self.epoch, "ok": True}

    # -- borrowing --------------------------------------------------------------------------------
    def borrow(self, body: dict) -> dict:
        """Turn borrowing on under a policy (``dry_run``: only say what it would do now)."""
        policy = str(body.get("policy") or "")
        max_gpus = body.get("gpus")
        if max_gpus is not None and (not isinstance(max_gpus, int) or max_gpus < 1):
            raise ControlError(f"gpus must be an integer >= 1, got {max_gpus!r}")
        try:
            module = load_policy(policy)
        except PolicyError as exc:
            raise ControlError(str(exc)) from None
        if getattr(module, "NEEDS_PROFILE", False) and not self.store.get_run(self.run_id).get("profile"):
            raise ControlError(
                f"policy {policy} predicts rollout time with the run's engine profile, and run {self.run_id} has "
                "none: measure one with `pearlctl profile RUN` (a serving worker) or import a file with "
                "`pearlctl profile RUN --import FILE`"
            )
        with self.lock:
            settings = {"policy": policy, "max_gpus": max_gpus, "keep_warm": bool(body.get("keep_warm", True))}
            if body.get("dry_run"):
                plan = self.borrowing.plan_borrow(self.clock(), settings)
                view = self.borrowing.view(self.clock(), settings)
                return {"epoch": self.epoch, "dry_run": True, "settings": settings, "plan": plan, "view": view}
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

    def give_back(self, body: dict) -> dict:
        """Stop borrowing; lent GPUs go back (``now``: abort a borrow that is still starting).

        Their vLLM workers stop, unless ``keep_warm``: then they are parked asleep for a later borrow."""
        with self.lock:
            keep_warm = bool(body.get("keep_warm", False))
            settings = {"policy": "never", "max_gpus": None, "keep_warm": keep_warm}
            self.store.update_fields(
                "runs",
                self.run_id,
                epoch=self.epoch,
                event="return requested",
                data={"now": bool(body.get("now")), "keep_warm": keep_warm},
                borrow=settings,
                policy="never",
            )
            aborted = []
            if body.get("now"):
                for t in self.borrowing.executor.open_transitions():
                    if t["kind"] == "borrow":
                        self.borrowing.executor.abort(t["id"], "pearlctl return --now")
                        aborted.append(t["id"])
            lent = [g["id"] for g in self.store.gpus(self.run_id) if g["borrowed"]]
            return {"epoch": self.epoch, "aborted": aborted, "lent_gpus": lent}

    def set_profile(self, body: dict) -> dict:
        """Store the run's engine profile (``pearlctl profile``): the planner predicts with it."""
        try:
            profile = profiles.from_dict(body["profile"], where="the profile sent")
        except profiles.ProfileError as exc:
            raise ControlError(str(exc), 400) from None
        with self.lock:
            doc = profiles.to_dict(profile)
            self.store.update_fields(
                "runs", self.run_id, epoch=self.epoch, event="profile stored", data={"name": profile.name}, profile=doc
            )
            return {"epoch": self.epoch, "profile": doc}

    def rollout_progress(self, body: dict) -> dict:
        """The rollout driver's counts (queued, generating, tool_wait, done, tokens): kept for status and
        the planner; throughput is derived from successive reports."""
        with self.lock:
            run = self.store.get_run(self.run_id)
            before = run.get("rollout") or {}
            now = self.clock()
            report = {k: body.get(k) for k in ("step", "queued", "generating", "tool_wait", "done", "tokens")}
            report["reported_at"] = now
            if body.get("work") is not None:  # what the planner predicts with (planner.model.Work's fields)
                report["work"] = _work_fields(body["work"])
            if before.get("tokens") is not None and report.get("tokens") is not None and now > before["reported_at"]:
                report["tokens_per_s"] = round((report["tokens"] - before["tokens"]) / (now - before["reported_at"]), 2)
            self.store.update_fields("runs", self.run_id, epoch=self.epoch, rollout=report)
            return {"epoch": self.epoch}

    # -- rollout clients --------------------------------------------------------------------------
    def routable_workers(self, body: dict) -> dict:
        """READY, registered rollout workers: where rollout clients may send requests now."""
        workers = [
            {"id": w["id"], "url": w["url"], "role": w["role"], "weight_version": w.get("weight_version")}
            for w in self.store.workers(self.run_id)
            if w["routable"] and w["state"] == W.READY and w["url"]
        ]
        return {"epoch": self.epoch, "workers": workers}

    # -- agent loss -------------------------------------------------------------------------------
    def check_agents(self) -> list[int]:
        """Mark GPUs and workers of silent agents LOST; returns the allocation ids marked.

        A daemon that just started gives agents one loss window to find it: their last heartbeat went to
        the daemon before, so its age says nothing yet (judging them at once would, after every restart,
        mark live workers LOST and plan around them — a parked worker passed over for a cold start)."""
        with self.lock:
            if self.clock() - self.started_at < self.lost_after * self.heartbeat_s:
                return []
            deadline = self.clock() - self.lost_after * self.heartbeat_s
            marked = []
            workers = self.store.workers(self.run_id)
            for alloc in self.store.allocations(self.run_id):
                seen = alloc.get("agent_seen_at")
                gone = alloc["state"] in (A.ENDED, A.LOST)
                if seen is None or (not gone and (seen > deadline or self.polling[alloc["id"]] > 0)):
                    continue
                hit = self._mark_gpus_lost(alloc["id"], "agent silent", {"last_seen": seen})
                for w in workers:
                    if w["allocation_id"] == alloc["id"] and w["state"] not in (W.STOPPED, W.FAILED, W.LOST):
                        self.store.set_state(
                            "workers",
                            w["id"],
                            expect=w["state"],
                            to=W.LOST,
                            epoch=self.epoch,
                            event="agent silent",
                            data={"last_seen": seen},
                        )
                        hit = True
                if hit:
                    marked.append(alloc["id"])
            return marked
