"""Growth of the elastic pool: adding the tasks the pool's driver (pearlctl.daemon.elastic) found missing, one
sbatch each, never twice and never past ``max_nodes``, and holding growth back while Slurm cannot start them.

- **One task per missing one.** Each is a one-task array (``--array=K``, K the pool's next free task index)
  rendered from the pool's own launch request, so it runs the same wrapper, on the same (preemptible)
  partition, under the same job name ``pearl.<run_id>.<pool>`` (pearlctl.ops.launcher.grow_request). State
  keys it ``(its job id, K)`` like every launched task, the watcher polls it with the run's other jobs, and
  a preempted task that Slurm requeues re-joins as any launched task does.
- **Intent first.** A task's allocation row is written REQUESTED (journaled ``elastic grow`` with the
  reason) *before* its sbatch, and its job id is recorded right after. A daemon that crashed in between
  finds the task under the job name and adopts it (``adopted``). A REQUESTED row is submitted again only
  when no task of its index is found under the name *and* the row is older than a Slurm command may take
  (``SUBMIT_SETTLE_S``: a crashed daemon's sbatch may still be in flight): a task is never submitted twice.
- **Never more than max_nodes.** The ceiling is checked against every live row *and* every task found under
  the pool's job name that state does not know, so not even a crash between sbatch and the state write can
  push the pool past it.
- **Pending bound and back-off.** A task the pool added (task index >= ``nodes``: the launch's tasks are
  the pool's floor and wait as long as Slurm makes them) that stays PENDING longer than the pool's
  ``pending_timeout_s`` since it was submitted or requeued is asked to leave (``elastic pending timeout``;
  the driver scancels it), and growth backs off: no new task for ``pending_timeout_s``, doubled after each
  further timeout (at most ``MAX_BACKOFF_FACTOR`` times), back to ``pending_timeout_s`` once a task of the
  pool starts. A failed sbatch backs off the same way. A full cluster is never hammered with sbatch.
- **Crash points.** ``fault(point, "elastic:<allocation id>:GROW")`` is called at ``after_intent`` (the
  REQUESTED row is committed, its sbatch not run) and ``after_effect`` (sbatch returned, its job id not
  recorded); see the driver's docstring.

Decisions and writes are made under ``lock`` (the daemon's decision lock); squeue and sbatch run with no lock
held. Every write carries the daemon's lease epoch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pearlctl.backends import Backend, BackendError
from pearlctl.daemon.elastic_state import POOL, PoolSnapshot, SizeHistory, read_pool
from pearlctl.ops.launcher import grow_request
from pearlctl.slurm.client import DEFAULT_TIMEOUT_S
from pearlctl.slurm.records import JobPhase
from pearlctl.slurm.script import job_name, render_script
from pearlctl.state.errors import StaleWrite
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import RunState
from pearlctl.state.store import Store

# A REQUESTED row another daemon wrote is submitted again only once its sbatch, if any, must be over.
SUBMIT_SETTLE_S = DEFAULT_TIMEOUT_S + 5.0
# Back-off after a pending timeout or a failed sbatch: pending_timeout_s, doubled per repeat, at most this many.
MAX_BACKOFF_FACTOR = 8


class Growth:
    """Adds the elastic pool's missing tasks and bounds how long added ones may pend (see the module's
    docstring). The driver calls ``grow`` with no lock held and ``time_out_pending`` under its lock."""

    def __init__(
        self,
        store: Store,
        backend: Backend,
        run_id: str,
        *,
        epoch: int | None,
        lock: threading.RLock,
        clock: Callable[[], float],
        pool: str,
        fault: Callable[[str, str], None],
        history: SizeHistory,
    ):
        self.store, self.backend, self.run_id, self.epoch = store, backend, run_id, epoch
        self.lock, self.clock, self.pool, self.fault, self.history = lock, clock, pool, fault, history
        self.job_name = job_name(run_id, pool)
        self._mine: set[int] = set()  # REQUESTED rows this instance wrote and has not submitted yet
        self._held: float | None = None  # the back-off (its end) whose holding of growth was journaled

    def grow(self) -> None:
        """Adopt what a crash left, then add and submit the tasks still missing. One squeue (by job name)
        and one sbatch per task, all with no lock held."""
        found = self.backend.find_by_name(self.job_name)
        submit: list[dict] = []
        with self.lock:
            p = read_pool(self.store, self.run_id, self.pool)
            if p is None or p.run["state"] != RunState.ACTIVE:
                return
            now = self.clock()
            strays = self._adopt(p, found)
            self._add_missing(read_pool(self.store, self.run_id, self.pool), strays, now)
            p = read_pool(self.store, self.run_id, self.pool)
            for a in p.live:
                if a.state != A.REQUESTED or a.job_id:
                    continue
                if a.id in self._mine or now - a.updated_at >= SUBMIT_SETTLE_S:
                    submit.append(a)
            run = p.run
            self.history.note(p)
        self._submit(run, submit)

    def _add_missing(self, p: PoolSnapshot, strays: list[tuple[str, int]], now: float) -> None:
        """Write a REQUESTED row (the intent) for each task missing from the wanted size, as many as
        ``max_nodes`` leaves room for next to the live rows and the ``strays`` no row knows; none while
        backing off (journaled ``elastic grow held`` once per back-off). Under the lock."""
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

    def _submit(self, run: dict, submit: list[dict]) -> None:
        """One sbatch per row of ``submit`` (no lock held), each job id recorded right after; the first
        failure ends that row and the rest, and backs growth off."""
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
                self.history.note(read_pool(self.store, self.run_id, self.pool))

    def _adopt(self, p: PoolSnapshot, found: list) -> list[tuple[str, int]]:
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
            p = read_pool(self.store, self.run_id, self.pool)
            self._back_off(p, self.clock(), f"sbatch failed: {error}")
            self.history.note(read_pool(self.store, self.run_id, self.pool))

    # -- the pending bound and the back-off -------------------------------------------------------
    def time_out_pending(self, p: PoolSnapshot, now: float) -> None:
        """Ask the added tasks PENDING longer than ``pending_timeout_s`` to leave (journaled, with a back-off
        of growth), after resetting the back-off's length if a task started since it began. Under the lock,
        while the run is active."""
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
            p = read_pool(self.store, self.run_id, self.pool)
            self._back_off(p, now, f"{len(overdue)} task(s) pending longer than {bound:g}s")

    def _back_off(self, p: PoolSnapshot, now: float, why: str) -> None:
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

    def _reset_backoff(self, p: PoolSnapshot, now: float) -> None:
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
