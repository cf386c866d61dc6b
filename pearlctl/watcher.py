"""The allocation watcher: one batched poll of the scheduler, folded into state.

:func:`sync_run` is the passive half of reconciliation (Ray autoscaler's term): it reads the truth from
Slurm (or the local backend) and moves each allocation along its state machine, journaling what it
saw — ``started``, ``preempted`` (grace time running), ``requeued``, ``ended``, ``vanished`` — and
keeps the run's nodes and GPUs in step. One call costs one backend poll for all of a run's jobs.

:func:`maybe_sync` is how readers keep state fresh while no daemon runs: at most one poll per poll
interval for a run, across every shell, enforced with a lease in state; when a daemon holds the run's
lease it is the only writer and readers only read.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

from pearlctl.backends import Backend
from pearlctl.slurm.records import JobPhase, JobRecord
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState, RunState
from pearlctl.state.store import Store, run_lease_name

LIVE = (A.PENDING, A.RUNNING, A.PREEMPTING, A.LOST)


@dataclass
class SyncReport:
    polled: bool
    events: list[str] = field(default_factory=list)


def poll_lease_name(run_id: str) -> str:
    return f"poll:{run_id}"


def _record_for(records: list[JobRecord], job_id: str, index: int) -> JobRecord | None:
    fallback = None
    for r in records:
        if r.job_id != job_id:
            continue
        if r.array_task_id == index:
            return r
        if index in r.pending_tasks:
            fallback = r
    return fallback


class _Mover:
    """Applies observed facts to one allocation row, journaling each edge it takes."""

    def __init__(self, store: Store, run_id: str, pool: dict, alloc: dict, now: float):
        self.store, self.run_id, self.pool, self.alloc, self.now = store, run_id, pool, alloc, now
        self.events: list[str] = []

    def move(self, to: A, event: str, data: dict | None = None, **fields) -> None:
        a = self.alloc
        self.store.set_state(
            "allocations",
            a["id"],
            expect=a["state"],
            expect_version=a["version"],
            to=to,
            event=event,
            data=data,
            **fields,
        )
        a["state"], a["version"] = to, a["version"] + 1
        a.update(fields)
        self.events.append(f"{self.pool['name']}[{a['array_index']}] {event} -> {to}")

    def gpus_down(self, to: GpuState) -> None:
        for gpu in self.store.gpus(self.run_id):
            if gpu["allocation_id"] == self.alloc["id"] and gpu["state"] == GpuState.UP:
                self.store.set_state(
                    "gpus",
                    gpu["id"],
                    expect=GpuState.UP,
                    expect_version=gpu["version"],
                    to=to,
                    event=f"allocation {self.alloc['state'].lower()}",
                )

    def apply(self, rec: JobRecord | None) -> None:
        a = self.alloc
        state = A(a["state"])
        if state in (A.REQUESTED, A.ENDED):
            return
        if rec is None:
            if state != A.LOST:
                self.move(A.LOST, "vanished", {"why": "not in squeue, sacct or scontrol"})
                self.gpus_down(GpuState.LOST)
            return
        facts = {"slurm_state": rec.state, "reason": rec.reason}
        phase = rec.phase
        if phase is JobPhase.UNKNOWN:
            if rec.state != a.get("slurm_state"):
                self.store.update_fields(
                    "allocations",
                    a["id"],
                    event="unknown_slurm_state",
                    data={"slurm_state": rec.state},
                    slurm_state=rec.state,
                )
            return
        if phase is JobPhase.PENDING:
            if state in (A.RUNNING, A.PREEMPTING):
                self.move(A.PENDING, "requeued", {"restarts": rec.restarts}, restarts=rec.restarts, **facts)
                self.gpus_down(GpuState.GONE)
            elif state is A.LOST:
                self.move(A.PENDING, "found", facts, **facts)
            elif (rec.state, rec.reason) != (a.get("slurm_state"), a.get("reason")):
                self.store.update_fields("allocations", a["id"], **facts)
            return
        if phase is JobPhase.ENDED:
            self.move(
                A.ENDED,
                "ended",
                {"slurm_state": rec.state, "exit_code": rec.exit_code},
                ended_at=rec.end_time or self.now,
                **facts,
            )
            self.gpus_down(GpuState.GONE)
            return
        # RUNNING
        node = rec.nodes[0] if rec.nodes else None
        if state in (A.RUNNING, A.PREEMPTING) and rec.restarts > (a.get("restarts") or 0):
            # The task was requeued and restarted between two polls: record both edges we missed.
            self.move(A.PENDING, "requeued", {"restarts": rec.restarts, "seen": "between polls"}, restarts=rec.restarts)
            self.gpus_down(GpuState.GONE)
            state = A.PENDING
        if state in (A.PENDING, A.LOST):
            self.move(
                A.RUNNING,
                "started",
                {"node": node, "restarts": rec.restarts},
                node=node,
                started_at=rec.start_time or self.now,
                restarts=rec.restarts,
                **facts,
            )
            self._register_gpus(rec, node)
            state = A.RUNNING
        new_preemption = rec.preempt_time is not None and (
            a.get("preempted_at") is None or rec.preempt_time > a["preempted_at"] + 0.5
        )
        if state is A.RUNNING and new_preemption and (rec.start_time is None or rec.preempt_time >= rec.start_time):
            self.move(
                A.PREEMPTING, "preempted", {"preempt_time": rec.preempt_time}, preempted_at=rec.preempt_time, **facts
            )
            self.gpus_down(GpuState.DRAINING)
        elif rec.state != a.get("slurm_state"):
            self.store.update_fields("allocations", a["id"], **facts)

    def _register_gpus(self, rec: JobRecord, node: str | None) -> None:
        if node is None:
            return
        indices = list(rec.gpus.get(node, ()))
        if not indices and self.pool["gpus_per_node"]:
            # The backend does not report device indices (local backend): number them 0..n-1.
            indices = list(range(self.pool["gpus_per_node"]))
        self.store.upsert_node_gpus(self.run_id, self.alloc["id"], node, indices, self.pool["role"])


def sync_run(store: Store, backend: Backend, run_id: str, *, now: float | None = None) -> SyncReport:
    """Poll the backend once for every job of the run and fold the answer into state."""
    now = time.time() if now is None else now
    pools = {p["id"]: p for p in store.pools(run_id)}
    allocs = [a for a in store.allocations(run_id) if a["state"] in LIVE]
    job_ids = sorted({a["job_id"] for a in allocs if a["job_id"]})
    report = SyncReport(polled=bool(job_ids))
    records = backend.poll(job_ids) if job_ids else []
    for alloc in allocs:
        if not alloc["job_id"]:
            continue
        mover = _Mover(store, run_id, pools[alloc["pool_id"]], dict(alloc), now)
        mover.apply(_record_for(records, alloc["job_id"], alloc["array_index"]))
        report.events += mover.events
    store.update_fields("runs", run_id, last_poll_at=now)
    run = store.get_run(run_id)
    if run["state"] == RunState.ACTIVE and all(a["state"] == A.ENDED for a in store.allocations(run_id)):
        store.set_state(
            "runs",
            run_id,
            expect=RunState.ACTIVE,
            expect_version=run["version"],
            to=RunState.ENDED,
            event="all allocations ended",
        )
        report.events.append("run ended")
    return report


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def maybe_sync(store: Store, backend: Backend, run: dict, *, holder: str | None = None) -> SyncReport:
    """Sync unless a daemon owns the run or another reader polled within the poll interval."""
    if run["state"] not in (RunState.ACTIVE, RunState.CANCELLING, RunState.SUBMITTING):
        return SyncReport(polled=False)
    daemon = store.lease(run_lease_name(run["id"]))
    if daemon and daemon["expires_at"] > time.time():
        return SyncReport(polled=False)
    interval = float(run["spec"].get("poll_interval_s", 5.0))
    last = run.get("last_poll_at") or 0.0
    if time.time() - last < interval * 0.9:
        return SyncReport(polled=False)
    if store.acquire_lease(poll_lease_name(run["id"]), holder or holder_id(), interval * 0.9) is None:
        return SyncReport(polled=False)
    return sync_run(store, backend, run["id"])
