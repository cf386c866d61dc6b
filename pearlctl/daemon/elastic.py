"""Elastic growth and shrink: the component that makes a run's elastic pool hold the number of tasks the
daemon wants, and no other number, safely.

The daemon decides *how many* tasks the pool should hold (``want``: from its policy's plan); this module
makes Slurm (or the local backend) hold that many, within ``[pools.elastic] nodes .. max_nodes``:

- **Growth** submits one more task per missing one: a one-task array (``--array=K``, K the pool's next
  free task index) rendered from the pool's own launch request, so it runs the same wrapper, on the same
  (preemptible) partition, under the same job name ``pearl.<run_id>.<pool>`` (pearlctl.ops.launcher.grow_request).
  State keys it ``(its job id, K)`` like every launched task, the watcher polls it with the run's other
  jobs, and a preempted task that Slurm requeues re-joins as any launched task does.
- **Intent first.** A task's allocation row is written REQUESTED (journaled ``elastic grow`` with the
  reason) *before* its sbatch, and its job id is recorded right after. A daemon that crashed in between
  finds the task under the job name and adopts it (``adopted``). A REQUESTED row is submitted again only
  when no task of its index is found under the name *and* the row is older than a Slurm command may take
  (a crashed daemon's sbatch may still be in flight): a task is never submitted twice.
- **Never more than max_nodes.** The ceiling is checked against every live row *and* every task found under
  the pool's job name that state does not know, so not even a crash between sbatch and the state write can
  push the pool past it. Growth never goes below ``nodes`` either: shrinking stops there.
- **Pending bound.** A task the pool added (task index >= ``nodes``: the launch's tasks are the pool's
  floor and wait as long as Slurm makes them) that stays PENDING longer than the pool's
  ``pending_timeout_s`` since it was submitted or requeued is cancelled (``elastic pending timeout``, then
  ``elastic scancel``), and growth backs off: no new task for ``pending_timeout_s``, doubled after each
  further timeout (at most ``MAX_BACKOFF_FACTOR`` times), back to ``pending_timeout_s`` once a task of the
  pool starts. A failed sbatch backs off the same way. A full cluster is never hammered with sbatch and
  scancel.
- **Shrink = drain, then scancel.** A surplus task (first those that serve nothing: PENDING, then those with
  a preemption notice or lost, then the newest running) gets ``drain_requested_at`` and its GPUs DRAINING
  (``elastic drain``): its workers leave routing at once and, with no UP GPU left, the controller desires
  none, so its agent drains and stops them. Once none of its workers is starting, serving, draining or
  asleep — or after the pool's ``preempt_notice_s`` at the latest — that task alone is scancelled
  (``scancel JOB_K``, ``elastic scancel``) and the watcher ends it. If the daemon wants more tasks again
  before the scancel, a draining running task is taken back (``elastic undrain``) before anything is
  submitted.
- **Slurm never runs under the lock.** Every method decides and records under ``lock`` (the daemon's
  decision lock) and runs squeue / sbatch / scancel with no lock held, like ``watcher.poll_run`` and
  ``apply_poll``. Every write carries the daemon's lease epoch.
- **Crash-tested at its boundaries.** ``fault(point, key)`` (a no-op unless the daemon's ``PEARL_FAULT`` sets
  one: pearlctl.daemon.main.fault_from_env) is called where an effect is in doubt, with the keys
  ``elastic:<allocation id>:GROW`` (``after_intent``: the REQUESTED row is committed, its sbatch not run;
  ``after_effect``: sbatch returned, its job id not recorded) and ``elastic:<allocation id>:SHRINK``
  (``after_intent``: ``drain_requested_at`` is committed; ``after_effect``: its scancel returned); the real
  daemon is SIGKILLed there in tests/engines/test_crash_matrix_elastic.py.
- **Journaled, with a size history.** Each change of the pool's size or make-up is an ``elastic size`` event
  on the pool (size, running, pending, preempting, lost, draining, wanted): ``elastic_view`` reads the
  pool's state and that history for ``pearlctl status``.

Nothing here runs without a daemon: while none runs, the pool keeps whatever tasks it has.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pearlctl.backends import Backend, BackendError
from pearlctl.config import PoolSpec
from pearlctl.ops.launcher import grow_request, pool_spec_of
from pearlctl.slurm.client import DEFAULT_TIMEOUT_S
from pearlctl.slurm.records import JobPhase
from pearlctl.slurm.script import job_name, render_script
from pearlctl.state.errors import StaleWrite
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import RunState
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.store import Store
from pearlctl.vocabulary import PoolKind

POOL = PoolKind.ELASTIC
# Allocation states that hold a place in the pool (or wait for one).
LIVE = (A.REQUESTED, A.PENDING, A.RUNNING, A.PREEMPTING, A.LOST)
# Worker states that mean its engine may still run: a drained task is scancelled when none is left.
BUSY_WORKERS = (W.STARTING, W.READY, W.DRAINING, W.SLEEPING)
# A REQUESTED row another daemon wrote is submitted again only once its sbatch, if any, must be over.
SUBMIT_SETTLE_S = DEFAULT_TIMEOUT_S + 5.0
# A scancel sent is sent again if the task is still live this long after.
RESEND_SCANCEL_S = 30.0
# Back-off after a pending timeout or a failed sbatch: pending_timeout_s, doubled per repeat, at most this many.
MAX_BACKOFF_FACTOR = 8
HISTORY_LIMIT = 100  # size-history entries elastic_view returns
SIZE_EVENT = "elastic size"
SIZE_KEYS = ("size", "running", "pending", "preempting", "lost", "draining", "wanted")


@dataclass
class _Pool:
    """The pool as read under the lock: its row, its spec and its allocations (every state)."""

    run: dict
    row: dict
    spec: PoolSpec
    allocs: list[dict]

    @property
    def floor(self) -> int:
        return self.spec.nodes

    @property
    def ceiling(self) -> int:
        return max(self.spec.max_nodes or self.spec.nodes, self.spec.nodes)

    @property
    def live(self) -> list[dict]:
        return [a for a in self.allocs if a.state in LIVE]

    @property
    def draining(self) -> list[dict]:
        return [a for a in self.live if a.drain_requested_at is not None]

    @property
    def serving(self) -> list[dict]:
        """Live tasks not asked to leave: what counts towards the size the daemon wants."""
        return [a for a in self.live if a.drain_requested_at is None]

    def clamp(self, wanted: int) -> int:
        return min(max(int(wanted), self.floor), self.ceiling)

    def counts(self) -> dict:
        serving = self.serving
        return {
            "size": len(self.live),
            "running": sum(1 for a in serving if a.state == A.RUNNING),
            "pending": sum(1 for a in serving if a.state in (A.REQUESTED, A.PENDING)),
            "preempting": sum(1 for a in serving if a.state == A.PREEMPTING),
            "lost": sum(1 for a in serving if a.state == A.LOST),
            "draining": len(self.draining),
            "wanted": self.row.get("wanted"),
        }


def _read(store: Store, run_id: str, pool: str) -> _Pool | None:
    """The pool of the run named ``pool``, or None when the run has none."""
    row = next((p for p in store.runs.pools(run_id) if p["name"] == pool), None)
    if row is None:
        return None
    run = store.runs.get(run_id)
    allocs = [a for a in store.fleet.allocations(run_id) if a.pool_id == row["id"]]
    return _Pool(run, row, pool_spec_of(run, pool), allocs)


class ElasticPool:
    """Makes the run's elastic pool hold ``pools.wanted`` tasks (see the module's docstring).

    In the daemon: ``want(n, why)`` wherever the policy decides (state only, no Slurm); ``reconcile()`` on
    the Slurm thread after each poll's fold (``sync``, converge to what is wanted, ``step``). ``resize`` is
    ``want`` and an immediate converge, for callers on the Slurm thread (tests, a CLI). With no elastic pool
    in the run, every method does nothing (``enabled`` is False)."""

    def __init__(
        self,
        store: Store,
        backend: Backend,
        run_id: str,
        *,
        epoch: int | None,
        lock: threading.RLock | None = None,
        clock: Callable[[], float] = time.time,
        pool: str = POOL,
        routed: Callable[[], set[str]] | None = None,
        fault: Callable[[str, str], None] | None = None,
    ):
        self.store, self.backend, self.run_id, self.epoch = store, backend, run_id, epoch
        # fault injection for the crash tests: called with (point, key) where an effect is in doubt
        self.fault: Callable[[str, str], None] = fault or (lambda point, key: None)
        # what the run's router routes to (pearlctl.daemon.routing); None: no router, drain at once
        self.routed = routed
        self.lock = lock if lock is not None else threading.RLock()
        self.clock = clock
        self.pool = pool
        self.job_name = job_name(run_id, pool)
        self._mine: set[int] = set()  # REQUESTED rows this instance wrote and has not submitted yet
        self._scancelled: dict[int, float] = {}  # allocation id -> when its scancel was sent
        self._last_size: dict | None = None  # the last size-history entry (loaded from the journal)
        self._held: float | None = None  # the back-off (its end) whose holding of growth was journaled

    @property
    def enabled(self) -> bool:
        return any(p["name"] == self.pool for p in self.store.runs.pools(self.run_id))

    # -- what the daemon calls --------------------------------------------------------------------
    def want(self, wanted: int, why: str) -> int | None:
        """Record how many tasks the pool should hold, clamped to ``[nodes, max_nodes]`` (journaled as
        ``elastic wanted`` when it changes). Touches state only: callable from any thread. Returns the
        clamped number (None without an elastic pool)."""
        with self.lock:
            p = _read(self.store, self.run_id, self.pool)
            if p is None:
                return None
            n = p.clamp(wanted)
            if p.row.get("wanted") != n:
                self.store.update_fields(
                    "pools",
                    p.row["id"],
                    epoch=self.epoch,
                    event="elastic wanted",
                    data={"asked": int(wanted), "min": p.floor, "max": p.ceiling, "why": why},
                    wanted=n,
                )
            return n

    def sizing(self) -> dict | None:
        """What sizing the pool needs to know: its bounds, its running tasks, GPUs per task (None: no pool)."""
        p = _read(self.store, self.run_id, self.pool)
        if p is None:
            return None
        running = sum(1 for a in p.serving if a.state == A.RUNNING)
        return {"low": p.floor, "high": p.ceiling, "running": running, "gpus_per_node": p.spec.gpus_per_node}

    def resize(self, wanted: int, why: str) -> int | None:
        """``want`` and act on it now: grow (submit), or start draining the surplus and scancel what is
        drained. Runs Slurm commands: call it from the Slurm thread, never under the decision lock."""
        n = self.want(wanted, why)
        if n is not None:
            self.converge()
            self.step()
        return n

    def reconcile(self) -> None:
        """One pass for the daemon's Slurm thread, after the poll's fold: ``sync``, converge to the wanted
        size, ``step``."""
        self.sync()
        self.converge()
        self.step()

    def sync(self) -> None:
        """Passive: mark added tasks PENDING longer than ``pending_timeout_s`` for cancelling (journaled, with
        a back-off of growth), reset the back-off's length once a task started, and note the size."""
        with self.lock:
            p = _read(self.store, self.run_id, self.pool)
            if p is None:
                return
            if p.run["state"] == RunState.ACTIVE:
                now = self.clock()
                self._reset_backoff(p, now)
                bound = float(p.spec.pending_timeout_s or 0)
                overdue = []
                for a in p.serving:
                    if a.state != A.PENDING or a.array_index < p.floor:
                        continue
                    since = self.store.journal.entered_at("allocations", a.id, A.PENDING) or a.updated_at
                    if now - since >= bound:
                        overdue.append((a, since))
                for a, since in overdue:
                    self.store.update_fields(
                        "allocations",
                        a.id,
                        epoch=self.epoch,
                        event="elastic pending timeout",
                        data={
                            "pending_s": round(now - since, 3),
                            "pending_timeout_s": bound,
                            "slurm_id": f"{a.job_id}_{a.array_index}",
                            "reason": a.reason,
                        },
                        drain_requested_at=now,
                    )
                if overdue:
                    p = _read(self.store, self.run_id, self.pool)
                    self._back_off(p, now, f"{len(overdue)} task(s) pending longer than {bound:g}s")
            self._note_size(_read(self.store, self.run_id, self.pool))

    def converge(self) -> None:
        """Active: move the pool towards its wanted size. Too many tasks serving: drain the surplus (never
        below ``nodes``). Too few: take back draining running tasks first, then submit new ones (unless
        backing off), never past ``max_nodes``."""
        with self.lock:
            p = _read(self.store, self.run_id, self.pool)
            if p is None:
                return
            self._note_size(p)  # the size before this pass acts
            grow = False
            if p.run["state"] == RunState.ACTIVE and p.row.get("wanted") is not None:
                now = self.clock()
                target = p.clamp(p.row["wanted"])
                serving = len(p.serving)
                if serving > target:
                    self._drain(p, serving - target, now, f"the pool is wanted at {target} task(s), {serving} serve")
                elif serving < target:
                    serving += self._undrain(p, target - serving, now)
                    grow = serving < target
                # a crash between an intent and its sbatch left a row to adopt or to submit
                grow = grow or any(a.state == A.REQUESTED and not a.job_id for a in p.live)
            if not grow:
                self._note_size(_read(self.store, self.run_id, self.pool))
        if grow:
            self._grow()

    def step(self) -> None:
        """Scancel each draining task whose workers are gone (or whose drain took longer than the pool's
        ``preempt_notice_s``), one ``scancel JOB_K`` for all of them; keep the GPUs of those still draining
        DRAINING (an agent that comes back after a loss would otherwise bring them UP again)."""
        with self.lock:
            p = _read(self.store, self.run_id, self.pool)
            if p is None:
                return
            live_ids = {a.id for a in p.live}
            self._scancelled = {k: v for k, v in self._scancelled.items() if k in live_ids}
            self._out_of_router(p)
            to_cancel = self._due_for_scancel(p)
        if to_cancel:
            self._send_scancel(p, to_cancel)
        with self.lock:
            self._note_size(_read(self.store, self.run_id, self.pool))

    def _due_for_scancel(self, p) -> list:
        """The draining tasks to scancel now (under the lock); ends those already scancelled and gone from Slurm."""
        to_cancel: list = []
        if p.run["state"] != RunState.ACTIVE:
            return to_cancel
        now = self.clock()
        bound = float(p.spec.preempt_notice_s)
        workers = self.store.fleet.workers(self.run_id)
        for a in p.draining:
            if a.state == A.REQUESTED or not a.job_id:
                continue
            sent = self._scancelled.get(a.id)
            if a.state == A.LOST and (
                sent is not None or self.store.journal.entity_events("allocations", a.id, ["elastic scancel"])
            ):
                # scancelled, and now gone from squeue, sacct and scontrol: the end that was asked for
                self.store.set_state(
                    "allocations",
                    a.id,
                    expect=A.LOST,
                    expect_version=a.version,
                    to=A.ENDED,
                    event="elastic cancelled",
                    data={"was": "LOST", "why": "gone from Slurm after its scancel"},
                    epoch=self.epoch,
                    ended_at=now,
                )
                continue
            if sent is not None and now - sent < RESEND_SCANCEL_S:
                continue
            if a.state != A.PENDING and self.routed is None:
                # UP only: a LOST GPU stays LOST (the controller judges silent agents every tick);
                # with a router, _out_of_router does this once the router sends the task nothing
                self._gpus(a.id, (G.UP,), G.DRAINING, "elastic drain")
            # a PENDING task runs nothing, whatever an agent of its last run left in state
            busy = [
                w.id for w in workers if a.state != A.PENDING and w.allocation_id == a.id and w.state in BUSY_WORKERS
            ]
            waited = now - a.drain_requested_at
            if busy and waited < bound:
                continue
            why = "drained" if not busy else f"drain took longer than {bound:g}s"
            self.store.journal_event(
                self.run_id,
                "allocations",
                a.id,
                "elastic scancel",
                data={
                    "why": why,
                    "slurm_id": f"{a.job_id}_{a.array_index}",
                    "state": a.state,
                    "drain_s": round(waited, 3),
                    "workers_left": busy,
                    "again": sent is not None,
                },
                epoch=self.epoch,
            )
            self._scancelled[a.id] = now
            to_cancel.append(a)
        return to_cancel

    def _send_scancel(self, p, to_cancel: list) -> None:
        """One ``scancel`` for all of ``to_cancel`` (off the lock); on failure forget them and journal it."""
        try:
            self.backend.cancel_tasks([(a.job_id, int(a.array_index)) for a in to_cancel])
        except BackendError as exc:
            with self.lock:
                for a in to_cancel:
                    self._scancelled.pop(a.id, None)
                self.store.journal_event(
                    self.run_id,
                    "pools",
                    p.row["id"],
                    "elastic scancel failed",
                    data={"error": str(exc), "tasks": [f"{a.job_id}_{a.array_index}" for a in to_cancel]},
                    epoch=self.epoch,
                )
            raise
        for a in to_cancel:
            self.fault("after_effect", f"elastic:{a.id}:SHRINK")  # scancelled; its end not yet seen

    def view(self) -> dict | None:
        return elastic_view(self.store, self.run_id, pool=self.pool, now=self.clock())

    # -- growth -----------------------------------------------------------------------------------
    def _grow(self) -> None:
        """Adopt what a crash left, then add and submit the tasks still missing. One squeue (by job name)
        and one sbatch per task, all with no lock held."""
        found = self.backend.find_by_name(self.job_name)
        submit: list[dict] = []
        with self.lock:
            p = _read(self.store, self.run_id, self.pool)
            if p is None or p.run["state"] != RunState.ACTIVE:
                return
            now = self.clock()
            strays = self._adopt(p, found)
            p = _read(self.store, self.run_id, self.pool)
            target = p.clamp(p.row["wanted"]) if p.row.get("wanted") is not None else len(p.serving)
            room = p.ceiling - len(p.live) - len(strays)
            need = max(0, min(target - len(p.serving), room))
            until = p.row.get("backoff_until")
            if need and until is not None and now < until:
                if self._held != until:  # once per back-off
                    self._held = until
                    self.store.journal_event(
                        self.run_id,
                        "pools",
                        p.row["id"],
                        "elastic grow held",
                        data={"missing": need, "backoff_until": until, "why": "backing off"},
                        epoch=self.epoch,
                    )
                need = 0
            for _ in range(need):
                row = self.store.fleet.add_allocation(
                    self.run_id,
                    p.row["id"],
                    event="elastic grow",
                    data={
                        "why": f"the pool is wanted at {target} task(s), {len(p.serving)} serve",
                        "wanted": target,
                        "max": p.ceiling,
                        "unknown_tasks": len(strays),
                    },
                    epoch=self.epoch,
                )
                self._mine.add(row.id)
            p = _read(self.store, self.run_id, self.pool)
            for a in p.live:
                if a.state != A.REQUESTED or a.job_id:
                    continue
                if a.id in self._mine or now - a.updated_at >= SUBMIT_SETTLE_S:
                    submit.append(a)
            run = p.run
            self._note_size(p)
        for i, a in enumerate(submit):
            key = f"elastic:{a.id}:GROW"
            self.fault("after_intent", key)  # the REQUESTED row is committed; its sbatch has not run
            try:
                req = grow_request(run, self.pool, int(a.array_index))
                job_id = self.backend.submit(req, render_script(req))
            except (BackendError, ValueError) as exc:
                self._submit_failed(submit[i:], str(exc))
                return
            self.fault("after_effect", key)  # submitted; state does not know its job id yet
            self._record_submitted(a, job_id)
        if submit:
            with self.lock:
                self._note_size(_read(self.store, self.run_id, self.pool))

    def _adopt(self, p: _Pool, found: list) -> list[tuple[str, int]]:
        """Adopt, for each REQUESTED row without a job id, the task of its index found under the job name;
        return the live tasks found under the name that no row knows (counted against ``max_nodes``)."""
        known = {(a.job_id, int(a.array_index)) for a in p.allocs if a.job_id}
        owned = {a.job_id for a in p.allocs if a.job_id}
        unmatched: dict[tuple[str, int], object] = {}
        for r in found:
            for index in (r.array_task_id,) if r.array_task_id is not None else r.pending_tasks:
                if (r.job_id, index) not in known:
                    unmatched[(r.job_id, index)] = r
        for a in p.live:
            if a.state != A.REQUESTED or a.job_id:
                continue
            key = next((k for k in unmatched if k[1] == a.array_index and k[0] not in owned), None)
            if key is None:
                continue
            rec = unmatched.pop(key)
            ended = rec.phase is JobPhase.ENDED
            self.store.set_state(
                "allocations",
                a.id,
                expect=A.REQUESTED,
                expect_version=a.version,
                to=A.ENDED if ended else A.PENDING,
                event="adopted",
                data={"by": "job name", "name": self.job_name, "slurm_state": rec.state},
                epoch=self.epoch,
                job_id=key[0],
            )
            self._mine.discard(a.id)
        return [k for k, r in unmatched.items() if r.phase is not JobPhase.ENDED]

    def _record_submitted(self, a: dict, job_id: str) -> None:
        """Record an added task's job id (REQUESTED -> PENDING). If the row moved meanwhile (the run was
        cancelled and ended it), the task just submitted is cancelled: nobody would ever end it."""
        orphan = False
        with self.lock:
            try:
                self.store.set_state(
                    "allocations",
                    a.id,
                    expect=A.REQUESTED,
                    expect_version=a.version,
                    to=A.PENDING,
                    event="submitted",
                    data={"by": POOL, "slurm_id": f"{job_id}_{a.array_index}"},
                    epoch=self.epoch,
                    job_id=job_id,
                )
            except StaleWrite as exc:
                orphan = True
                self.store.journal_event(
                    self.run_id,
                    "allocations",
                    a.id,
                    "elastic submitted too late",
                    data={"job_id": job_id, "why": str(exc)},
                    epoch=self.epoch,
                )
            self._mine.discard(a.id)
        if orphan:
            self.backend.cancel([job_id])

    def _submit_failed(self, rows: list[dict], error: str) -> None:
        """An sbatch failed: its row and those not yet submitted in this pass end (journaled with the
        error), and growth backs off."""
        with self.lock:
            for a in rows:
                self._mine.discard(a.id)
                try:
                    self.store.set_state(
                        "allocations",
                        a.id,
                        expect=A.REQUESTED,
                        expect_version=a.version,
                        to=A.ENDED,
                        event="elastic submit failed",
                        data={"error": error},
                        epoch=self.epoch,
                    )
                except StaleWrite:
                    pass  # ended meanwhile (the run was cancelled): nothing of it was submitted here
            p = _read(self.store, self.run_id, self.pool)
            self._back_off(p, self.clock(), f"sbatch failed: {error}")
            self._note_size(_read(self.store, self.run_id, self.pool))

    # -- shrink -----------------------------------------------------------------------------------
    def _drain(self, p: _Pool, surplus: int, now: float, why: str) -> None:
        """Ask ``surplus`` tasks to leave: first those serving nothing (PENDING), then those leaving anyway
        (a preemption notice, or lost), then the newest running ones."""
        rank = {A.PENDING: 0, A.PREEMPTING: 1, A.LOST: 1, A.RUNNING: 2}
        candidates = sorted((a for a in p.serving if a.state in rank), key=lambda a: (rank[a.state], -a.array_index))
        for a in candidates[:surplus]:
            self.store.update_fields(
                "allocations",
                a.id,
                epoch=self.epoch,
                event="elastic drain",
                data={"why": why, "state": a.state, "slurm_id": f"{a.job_id}_{a.array_index}"},
                drain_requested_at=now,
            )
            self.fault("after_intent", f"elastic:{a.id}:SHRINK")  # asked to leave; its workers still routable
            self._unroute(a.id)
            if a.state != A.PENDING and self.routed is None:
                self._gpus(a.id, (G.UP,), G.DRAINING, "elastic drain")
            # with a router, the GPUs go DRAINING (their agent drains the workers) only once the router sends
            # them nothing new: see _out_of_router

    def _unroute(self, alloc_id: int) -> None:
        """The task's workers take no new requests: out of routing in state (the router follows)."""
        for w in self.store.fleet.workers(self.run_id):
            if w.allocation_id == alloc_id and w.routable:
                self.store.update_fields("workers", w.id, epoch=self.epoch, event="elastic drain", routable=0)

    def _out_of_router(self, p: _Pool) -> None:
        """Draining tasks whose workers the router no longer routes to: their GPUs go DRAINING now, so their
        agents drain and stop the workers — never while new requests may still reach them. A draining task's
        workers still routable in state (a daemon that crashed between the drain's request and their
        unrouting) are taken out first."""
        for a in p.draining:
            if a.state != A.PENDING:
                self._unroute(a.id)
        if self.routed is None:
            return
        routed = self.routed()
        workers = self.store.fleet.workers(self.run_id)
        for a in p.draining:
            if a.state == A.PENDING:
                continue
            urls = {w.url for w in workers if w.allocation_id == a.id and w.url and w.state in BUSY_WORKERS}
            if not urls & routed:
                self._gpus(a.id, (G.UP,), G.DRAINING, "elastic drain: out of the router")

    def _undrain(self, p: _Pool, count: int, now: float) -> int:
        """Take back up to ``count`` running tasks whose drain has not been scancelled yet; returns how many.
        Their workers come back (the controller desires them again once their GPUs are UP)."""
        taken = 0
        for a in sorted(p.draining, key=lambda a: a.array_index):
            if taken == count:
                break
            if a.state != A.RUNNING or a.id in self._scancelled:
                continue
            self.store.update_fields(
                "allocations",
                a.id,
                epoch=self.epoch,
                event="elastic undrain",
                data={"why": "wanted again before its scancel", "drain_s": round(now - a.drain_requested_at, 3)},
                drain_requested_at=None,
            )
            self._gpus(a.id, (G.DRAINING,), G.UP, "elastic undrain")
            taken += 1
        return taken

    def _gpus(self, alloc_id: int, from_states: tuple[G, ...], to: G, event: str) -> None:
        for g in self.store.fleet.gpus(self.run_id):
            if g.allocation_id == alloc_id and g.state in from_states:
                self.store.set_state(
                    "gpus",
                    g.id,
                    expect=g.state,
                    expect_version=g.version,
                    to=to,
                    event=event,
                    epoch=self.epoch,
                )

    # -- back-off and history ---------------------------------------------------------------------
    def _back_off(self, p: _Pool, now: float, why: str) -> None:
        base = float(p.spec.pending_timeout_s or 0)
        last = p.row.get("backoff_s")
        length = base if last is None else min(float(last) * 2, base * MAX_BACKOFF_FACTOR)
        self.store.update_fields(
            "pools",
            p.row["id"],
            epoch=self.epoch,
            event="elastic back-off",
            data={"why": why, "seconds": length, "until": now + length},
            backoff_until=now + length,
            backoff_s=length,
        )

    def _reset_backoff(self, p: _Pool, now: float) -> None:
        """A task of the pool started since the last back-off began: the next one starts short again."""
        length, until = p.row.get("backoff_s"), p.row.get("backoff_until")
        if length is None or until is None:
            return
        began = until - length
        started = [a for a in p.live if a.state == A.RUNNING and (a.started_at or 0) >= began]
        if started:
            a = started[0]
            self.store.update_fields(
                "pools",
                p.row["id"],
                epoch=self.epoch,
                event="elastic back-off reset",
                data={"why": f"task {a.job_id}_{a.array_index} started"},
                backoff_s=None,
            )

    def _note_size(self, p: _Pool | None) -> None:
        """Journal the pool's size and make-up when they changed since the last entry."""
        if p is None:
            return
        counts = p.counts()
        if self._last_size is None:
            last = self.store.journal.entity_events("pools", p.row["id"], [SIZE_EVENT], limit=1)
            self._last_size = {k: (last[0]["data"] or {}).get(k) for k in SIZE_KEYS} if last else {}
        if counts != self._last_size:
            self.store.journal_event(self.run_id, "pools", p.row["id"], SIZE_EVENT, data=counts, epoch=self.epoch)
            self._last_size = counts


def elastic_view(store: Store, run_id: str, *, pool: str = POOL, now: float | None = None) -> dict | None:
    """The elastic pool for ``status``: its bounds, the size wanted and now, its live tasks (pending,
    running, draining, ...) and its size history (the newest ``HISTORY_LIMIT`` entries). Reads state only;
    None when the run has no elastic pool."""
    p = _read(store, run_id, pool)
    if p is None:
        return None
    now = time.time() if now is None else now
    tasks = []
    for a in p.live:
        tasks.append(
            {
                "allocation_id": a.id,
                "array_index": a.array_index,
                "job_id": a.job_id,
                "slurm_id": f"{a.job_id}_{a.array_index}" if a.job_id else None,
                "state": a.state,
                "slurm_state": a.slurm_state,
                "node": a.node,
                "restarts": a.restarts or 0,
                "added": a.array_index >= p.floor,
                "draining": a.drain_requested_at is not None,
                "drain_requested_at": a.drain_requested_at,
                "pending_since": store.journal.entered_at("allocations", a.id, A.PENDING)
                if a.state == A.PENDING
                else None,
            }
        )
    history = [
        {"ts": j["ts"], **{k: (j["data"] or {}).get(k) for k in SIZE_KEYS}}
        for j in store.journal.entity_events("pools", p.row["id"], [SIZE_EVENT], limit=HISTORY_LIMIT)
    ]
    until = p.row.get("backoff_until")
    return {
        "pool": pool,
        "job_name": p.row["job_name"],
        "partition": p.row.get("partition"),
        "min": p.floor,
        "max": p.ceiling,
        "pending_timeout_s": p.spec.pending_timeout_s,
        "backoff_until": until if until is not None and until > now else None,
        **p.counts(),
        "tasks": tasks,
        "history": history,
    }
