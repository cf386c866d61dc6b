"""What the daemon knows about agents and workers, and the desired state it hands back.

Agents register once per process (``register``) and then heartbeat (``heartbeat``) with the workers
they actually run. The controller records that truth in state, answers with the workers the
allocation should run (derived from its GPUs' roles), and marks an agent's GPUs and workers LOST when
its heartbeats stop for ``lost_after`` heartbeat intervals. Every write carries the daemon's lease
epoch, so a deposed daemon cannot write; every answer carries it, so agents can ignore an older one.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from pearlctl.state.machines import MACHINES
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.store import Store

# Which engine serves which role.
ENGINE_FOR_ROLE = {"TRAIN": "deepspeed", "ROLLOUT": "vllm", "PREFILL": "vllm", "DECODE": "vllm", "REWARD": "vllm"}


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


@dataclass(frozen=True)
class DesiredWorker:
    key: str  # stable per allocation: "<role>-<first gpu>"
    role: str
    engine: str
    gpus: tuple[int, ...]
    state: str  # "RUNNING" | "SLEEPING" | "STOPPED"

    def as_dict(self) -> dict:
        return {"key": self.key, "role": self.role, "engine": self.engine, "gpus": list(self.gpus), "state": self.state}


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
        self._lock = threading.Lock()  # one decision at a time: HTTP threads and the loop share state

    # -- agents -----------------------------------------------------------------------------------
    def _allocation(self, job_id: str, task_id: int) -> dict:
        for a in self.store.allocations(self.run_id):
            if a["job_id"] == str(job_id) and a["array_index"] == int(task_id):
                return a
        raise ControlError(f"run {self.run_id} has no allocation for job {job_id} task {task_id}", 404)

    def register(self, body: dict) -> dict:
        """An agent starts (or restarts): bind it to its allocation and its GPUs."""
        with self._lock:
            alloc = self._allocation(body["job_id"], body["task_id"])
            if alloc["state"] in (A.ENDED, A.REQUESTED):
                raise ControlError(f"allocation {alloc['id']} is {alloc['state']}: not accepting agents", 409)
            gpus = [int(g) for g in body.get("gpus", [])]
            pool = next(p for p in self.store.pools(self.run_id) if p["id"] == alloc["pool_id"])
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
        """Record what the agent runs; answer with what it should run."""
        with self._lock:
            alloc_id = int(body["allocation_id"])
            alloc = self.store.get("allocations", alloc_id)
            if alloc["run_id"] != self.run_id:
                raise ControlError(f"allocation {alloc_id} is not in run {self.run_id}", 404)
            self.store.update_fields("allocations", alloc_id, epoch=self.epoch, agent_seen_at=self.clock())
            for report in body.get("workers", []):
                self._record_worker(alloc, report)
            if body.get("leaving"):
                # The agent is going away (scancel, end of the allocation): its GPUs are not plannable any
                # more from this moment, whatever Slurm says a poll later.
                self._mark_gpus_lost(alloc_id, "agent leaving")
                return {"epoch": self.epoch, "desired": [], "heartbeat_s": self.heartbeat_s}
            self._revive_gpus(alloc_id)
            return {
                "epoch": self.epoch,
                "desired": [w.as_dict() for w in self.desired(alloc_id)],
                "heartbeat_s": self.heartbeat_s,
            }

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

    def _record_worker(self, alloc: dict, report: dict) -> None:
        key, state = str(report["key"]), str(report["state"])
        existing = [
            w
            for w in self.store.workers(self.run_id)
            if w["allocation_id"] == alloc["id"] and w.get("worker_key") == key
        ]
        fields = {k: report[k] for k in ("url", "pid", "weight_version") if report.get(k) is not None}
        if not existing:
            if state in (W.STOPPED, W.FAILED):
                return
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
        else:
            worker = existing[0]
            if fields:
                self.store.update_fields("workers", worker["id"], epoch=self.epoch, **fields)
        current = worker["state"]
        if current == state or current in (W.STOPPED, W.FAILED) and state not in (W.STARTING,):
            return
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
            return
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

    # -- desired state ----------------------------------------------------------------------------
    def desired(self, alloc_id: int) -> list[DesiredWorker]:
        """One worker per role among the allocation's live GPUs; none while the allocation is not RUNNING."""
        alloc = self.store.get("allocations", alloc_id)
        if alloc["state"] not in (A.RUNNING,):
            return []
        by_role: dict[str, list[int]] = {}
        for g in self.store.gpus(self.run_id):
            if g["allocation_id"] == alloc_id and g["state"] == G.UP:
                by_role.setdefault(g["role"], []).append(g["idx"])
        out = []
        for role, idx in sorted(by_role.items()):
            if role == "IDLE":
                continue
            out.append(
                DesiredWorker(f"{role.lower()}-{min(idx)}", role, ENGINE_FOR_ROLE[role], tuple(sorted(idx)), "RUNNING")
            )
        return out

    # -- agent loss -------------------------------------------------------------------------------
    def check_agents(self) -> list[int]:
        """Mark GPUs and workers of silent agents LOST; returns the allocation ids marked."""
        with self._lock:
            deadline = self.clock() - self.lost_after * self.heartbeat_s
            marked = []
            workers = self.store.workers(self.run_id)
            for alloc in self.store.allocations(self.run_id):
                seen = alloc.get("agent_seen_at")
                gone = alloc["state"] in (A.ENDED, A.LOST)
                if seen is None or (seen > deadline and not gone):
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
