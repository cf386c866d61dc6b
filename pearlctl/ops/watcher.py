"""The allocation watcher: one batched poll of the scheduler, folded into state.

:func:`sync_run` is the passive half of reconciliation (Ray autoscaler's term): it reads the truth from
Slurm (or the local backend) and moves each allocation along its state machine, journaling what it
saw — ``started``, ``preempted`` (grace time running), ``requeued``, ``ended``, ``vanished`` — and
keeps the run's nodes and GPUs in step. One call costs one backend poll for all of a run's jobs.

:func:`poll_run` and :func:`apply_poll` are its two halves, for the daemon: the poll (which may block on a
slow slurmctld for as long as the Slurm command timeout) runs with no lock held; the fold runs under the
daemon's decision lock and re-reads every allocation, so a heartbeat that moved a row meanwhile is never
overwritten by a stale compare-and-set.

:func:`maybe_sync` is how readers keep state fresh while no daemon runs: at most one poll per poll
interval for a run, across every shell, enforced with a lease in state; when a daemon holds the run's
lease it is the only writer and readers only read.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pearlctl.backends import Backend
from pearlctl.slurm.records import JobPhase, JobRecord
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState, RunState
from pearlctl.state.rows import Allocation
from pearlctl.state.store import Store, run_lease_name
from pearlctl.vocabulary import POLL_INTERVAL_S

LIVE = (A.PENDING, A.RUNNING, A.PREEMPTING, A.LOST)


@dataclass
class SyncReport:
    polled: bool
    events: list[str] = field(default_factory=list)


def poll_lease_name(run_id: str) -> str:
    return f"poll:{run_id}"


def _record_for(records: list[JobRecord], job_id: str, index: int) -> JobRecord | None:
    """The record of task ``index`` of ``job_id``: its own, else the pending range that holds it, else a
    record of the whole job. Slurm 22.05 shows an array task cancelled while still pending, before it was
    ever split out of its array, only as the whole job's record (squeue: no task id and an empty task
    string; sacct: ``JOB_[K]``): an elastic pool's added one-task array cancelled for pending too long
    (pearlctl.daemon.elastic) looks like that, and it ended; it did not vanish."""
    fallback = whole = None
    for r in records:
        if r.job_id != job_id:
            continue
        if r.array_task_id == index:
            return r
        if index in r.pending_tasks:
            fallback = r
        elif r.array_task_id is None and not r.pending_tasks:
            whole = r
    return fallback or whole


def node_of(rec: JobRecord, index: int) -> str | None:
    """The node task ``index`` runs on: an array task's only node; node ``index`` of a multi-node job (one
    record for the whole job, its nodes in Slurm's order, which is ``SLURM_NODEID``'s)."""
    if rec.array_task_id is None and len(rec.nodes) > 1:
        return rec.nodes[index] if 0 <= index < len(rec.nodes) else None
    return rec.nodes[0] if rec.nodes else None


class _Mover:
    """Applies observed facts to one allocation row, journaling each edge it takes."""

    def __init__(self, store: Store, run_id: str, pool: dict, alloc: Allocation, now: float, epoch: int | None = None):
        self.store, self.run_id, self.pool, self.alloc, self.now = store, run_id, pool, alloc, now
        self.epoch = epoch  # the daemon's lease epoch: every write is fenced by it
        self.events: list[str] = []

    def move(self, to: A, event: str, data: dict | None = None, **fields) -> None:
        a = self.alloc
        self.store.set_state(
            "allocations",
            a.id,
            expect=a.state,
            expect_version=a.version,
            to=to,
            event=event,
            data=data,
            epoch=self.epoch,
            **fields,
        )
        self.alloc = replace(a, state=to, version=a.version + 1, **fields)
        self.events.append(f"{self.pool['name']}[{a.array_index}] {event} -> {to}")

    def gpus_down(self, to: GpuState) -> None:
        """UP GPUs go ``to``; when the allocation is over (``GONE``), DRAINING and LOST ones go with them."""
        leaving = (GpuState.UP,) if to != GpuState.GONE else (GpuState.UP, GpuState.DRAINING, GpuState.LOST)
        for gpu in self.store.fleet.gpus(self.run_id):
            if gpu.allocation_id == self.alloc.id and gpu.state in leaving:
                self.store.set_state(
                    "gpus",
                    gpu.id,
                    expect=gpu.state,
                    expect_version=gpu.version,
                    to=to,
                    event=f"allocation {self.alloc.state.lower()}",
                    epoch=self.epoch,
                )

    def apply(self, rec: JobRecord | None) -> None:
        state = A(self.alloc.state)  # self.alloc: as of the last move (each move makes a new row)
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
            if rec.state != self.alloc.slurm_state:
                self.store.update_fields(
                    "allocations",
                    self.alloc.id,
                    epoch=self.epoch,
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
            elif (rec.state, rec.reason) != (self.alloc.slurm_state, self.alloc.reason):
                self.store.update_fields("allocations", self.alloc.id, epoch=self.epoch, **facts)
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
        self._apply_running(rec, state, facts)

    def _apply_running(self, rec: JobRecord, state: A, facts: dict[str, Any]) -> None:
        """Follow a job record in Slurm's RUNNING phase (``apply``'s last case) from the allocation's ``state``."""
        node = node_of(rec, self.alloc.array_index)
        if rec.state.startswith("COMPLETING") and state in (A.RUNNING, A.PREEMPTING):
            # the run is ending (its processes exit). After a preemption Slurm already counts the restart and
            # stamps a new PreemptTime on the COMPLETING record: that is the requeue, not a new start.
            if rec.restarts > (self.alloc.restarts or 0):
                self.move(A.PENDING, "requeued", {"restarts": rec.restarts}, restarts=rec.restarts, **facts)
                self.gpus_down(GpuState.GONE)
            elif rec.state != self.alloc.slurm_state:
                self.store.update_fields("allocations", self.alloc.id, epoch=self.epoch, **facts)
            return
        if state in (A.RUNNING, A.PREEMPTING) and rec.restarts > (self.alloc.restarts or 0):
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
                # a new run of the task has a new agent: the last one's silence says nothing about it
                agent_seen_at=None if state is A.PENDING else self.alloc.agent_seen_at,
                **facts,
            )
            self._register_gpus(rec, node)
            state = A.RUNNING
        new_preemption = rec.preempt_time is not None and (
            self.alloc.preempted_at is None or rec.preempt_time > self.alloc.preempted_at + 0.5
        )
        if state is A.RUNNING and new_preemption and (rec.start_time is None or rec.preempt_time >= rec.start_time):
            self.move(
                A.PREEMPTING, "preempted", {"preempt_time": rec.preempt_time}, preempted_at=rec.preempt_time, **facts
            )
            self.gpus_down(GpuState.DRAINING)
        elif rec.state != self.alloc.slurm_state:
            self.store.update_fields("allocations", self.alloc.id, epoch=self.epoch, **facts)

    def _register_gpus(self, rec: JobRecord, node: str | None) -> None:
        if node is None:
            return
        indices = list(rec.gpus.get(node, ()))
        if not indices and self.pool["gpus_per_node"]:
            # The backend does not report device indices (local backend): number them 0..n-1.
            indices = list(range(self.pool["gpus_per_node"]))
        self.store.fleet.upsert_node_gpus(
            self.run_id, self.alloc.id, node, indices, self.pool["role"], epoch=self.epoch
        )


@dataclass(frozen=True)
class Poll:
    """One poll's answer: the jobs asked about, and what the backend said of them."""

    job_ids: frozenset[str]
    records: tuple[JobRecord, ...]


def poll_run(store: Store, backend: Backend, run_id: str) -> Poll:
    """One backend poll for every live job of the run. May block on a slow scheduler: the daemon calls it
    without holding any lock."""
    job_ids = sorted({a.job_id for a in store.fleet.allocations(run_id) if a.state in LIVE and a.job_id})
    return Poll(frozenset(job_ids), tuple(backend.poll(job_ids)) if job_ids else ())


def apply_poll(
    store: Store, run_id: str, poll: Poll, *, now: float | None = None, epoch: int | None = None
) -> SyncReport:
    """Fold one poll's answer into state: every allocation is re-read here, so the answer of a poll that
    took long is compared with the state of now, not of when it was sent. Writes are fenced by ``epoch``."""
    now = time.time() if now is None else now
    pools = {p["id"]: p for p in store.runs.pools(run_id)}
    report = SyncReport(polled=bool(poll.job_ids))
    for alloc in store.fleet.allocations(run_id):
        # only jobs this poll asked about: one submitted meanwhile is not "vanished" from an older answer
        if alloc.state not in LIVE or alloc.job_id not in poll.job_ids:
            continue
        mover = _Mover(store, run_id, pools[alloc.pool_id], alloc, now, epoch)
        mover.apply(_record_for(list(poll.records), alloc.job_id, alloc.array_index))
        report.events += mover.events
    store.update_fields("runs", run_id, epoch=epoch, bookkeeping=True, last_poll_at=now)  # derives nothing
    run = store.runs.get(run_id)
    if run["state"] == RunState.ACTIVE and all(a.state == A.ENDED for a in store.fleet.allocations(run_id)):
        store.set_state(
            "runs",
            run_id,
            expect=RunState.ACTIVE,
            expect_version=run["version"],
            to=RunState.ENDED,
            event="all allocations ended",
            epoch=epoch,
        )
        report.events.append("run ended")
    return report


def sync_run(
    store: Store, backend: Backend, run_id: str, *, now: float | None = None, epoch: int | None = None
) -> SyncReport:
    """Poll the backend once for every job of the run and fold the answer into state."""
    return apply_poll(store, run_id, poll_run(store, backend, run_id), now=now, epoch=epoch)


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def maybe_sync(store: Store, backend: Backend, run: dict, *, holder: str | None = None) -> SyncReport:
    """Sync unless a daemon owns the run or another reader polled within the poll interval."""
    if run["state"] not in (RunState.ACTIVE, RunState.CANCELLING, RunState.SUBMITTING):
        return SyncReport(polled=False)
    daemon = store.leases.get(run_lease_name(run["id"]))
    if daemon and daemon["expires_at"] > time.time():
        return SyncReport(polled=False)
    interval = float(run["spec"].get("poll_interval_s", POLL_INTERVAL_S))
    last = run.get("last_poll_at") or 0.0
    if time.time() - last < interval * 0.9:
        return SyncReport(polled=False)
    if store.leases.acquire(poll_lease_name(run["id"]), holder or holder_id(), interval * 0.9) is None:
        return SyncReport(polled=False)
    return sync_run(store, backend, run["id"])
