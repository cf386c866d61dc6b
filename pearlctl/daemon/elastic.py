"""The elastic pool's driver: makes a run's elastic pool hold the number of tasks the daemon wants, and no
other number, safely.

The daemon decides *how many* tasks the pool should hold (``want``: from its policy's plan); ``ElasticPool``
makes Slurm (or the local backend) hold that many, within ``[pools.elastic] nodes .. max_nodes``. Each pass
reads the pool as state holds it (pearlctl.daemon.elastic_state) and moves it towards the wanted size:

- **Growth** (pearlctl.daemon.elastic_grow) submits one more task per missing one, intent first (a REQUESTED
  row before its sbatch, adopted under the job name after a crash), never twice and never past ``max_nodes``,
  and backs off while added tasks stay PENDING longer than the pool's ``pending_timeout_s`` or sbatch fails.
  Growth never goes below ``nodes`` either: shrinking stops there.
- **Shrink = drain, then scancel** (here). A surplus task (first those that serve nothing: PENDING, then those
  with a preemption notice or lost, then the newest running) gets ``drain_requested_at`` and its GPUs
  DRAINING (``elastic drain``): its workers leave routing at once and, with no UP GPU left, the controller
  desires none, so its agent drains and stops them. Once none of its workers is starting, serving, draining
  or asleep — or after the pool's ``preempt_notice_s`` at the latest — that task alone is scancelled
  (``scancel JOB_K``, ``elastic scancel``) and the watcher ends it. An added task that timed out PENDING is
  scancelled the same way. If the daemon wants more tasks again before the scancel, a draining running task
  is taken back (``elastic undrain``) before anything is submitted.
- **Slurm never runs under the lock.** Every method decides and records under ``lock`` (the daemon's
  decision lock) and runs squeue / sbatch / scancel with no lock held, like ``watcher.poll_run`` and
  ``apply_poll``. Every write carries the daemon's lease epoch.
- **Crash-tested at its boundaries.** ``fault(point, key)`` (a no-op unless the daemon's ``PEARL_FAULT`` sets
  one: pearlctl.daemon.main.fault_from_env) is called where an effect is in doubt, with the keys
  ``elastic:<allocation id>:GROW`` (``after_intent``: the REQUESTED row is committed, its sbatch not run;
  ``after_effect``: sbatch returned, its job id not recorded) and ``elastic:<allocation id>:SHRINK``
  (``after_intent``: ``drain_requested_at`` is committed; ``after_effect``: its scancel returned); the real
  daemon is SIGKILLed there in tests/engines/test_crash_matrix_elastic.py.
- **Journaled, with a size history.** Each pass notes the pool's size and make-up (``elastic size`` events,
  pearlctl.daemon.elastic_state.SizeHistory) that ``elastic_view`` shows in ``pearlctl status``.

Nothing here runs without a daemon: while none runs, the pool keeps whatever tasks it has.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pearlctl.backends import Backend, BackendError
from pearlctl.daemon.elastic_grow import Growth
from pearlctl.daemon.elastic_state import POOL, PoolSnapshot, SizeHistory, elastic_view, read_pool
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import RunState
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.store import Store

# Worker states that mean its engine may still run: a drained task is scancelled when none is left.
BUSY_WORKERS = (W.STARTING, W.READY, W.DRAINING, W.SLEEPING)
# A scancel sent is sent again if the task is still live this long after.
RESEND_SCANCEL_S = 30.0


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
        self._scancelled: dict[int, float] = {}  # allocation id -> when its scancel was sent
        self.history = SizeHistory(store, run_id, epoch=epoch)
        self.growth = Growth(
            store,
            backend,
            run_id,
            epoch=epoch,
            lock=self.lock,
            clock=clock,
            pool=pool,
            fault=self.fault,
            history=self.history,
        )

    @property
    def enabled(self) -> bool:
        return any(p["name"] == self.pool for p in self.store.runs.pools(self.run_id))

    # -- what the daemon calls --------------------------------------------------------------------
    def want(self, wanted: int, why: str) -> int | None:
        """Record how many tasks the pool should hold, clamped to ``[nodes, max_nodes]`` (journaled as
        ``elastic wanted`` when it changes). Touches state only: callable from any thread. Returns the
        clamped number (None without an elastic pool)."""
        with self.lock:
            p = read_pool(self.store, self.run_id, self.pool)
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
        p = read_pool(self.store, self.run_id, self.pool)
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
        """Passive: ask added tasks PENDING longer than ``pending_timeout_s`` to leave (journaled, with a
        back-off of growth: pearlctl.daemon.elastic_grow), and note the size."""
        with self.lock:
            p = read_pool(self.store, self.run_id, self.pool)
            if p is None:
                return
            if p.run["state"] == RunState.ACTIVE:
                self.growth.time_out_pending(p, self.clock())
            self.history.note(read_pool(self.store, self.run_id, self.pool))

    def converge(self) -> None:
        """Active: move the pool towards its wanted size. Too many tasks serving: drain the surplus (never
        below ``nodes``). Too few: take back draining running tasks first, then submit new ones (unless
        backing off), never past ``max_nodes``."""
        with self.lock:
            p = read_pool(self.store, self.run_id, self.pool)
            if p is None:
                return
            self.history.note(p)  # the size before this pass acts
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
                self.history.note(read_pool(self.store, self.run_id, self.pool))
        if grow:
            self.growth.grow()

    def step(self) -> None:
        """Scancel each draining task whose workers are gone (or whose drain took longer than the pool's
        ``preempt_notice_s``), one ``scancel JOB_K`` for all of them; keep the GPUs of those still draining
        DRAINING (an agent that comes back after a loss would otherwise bring them UP again)."""
        with self.lock:
            p = read_pool(self.store, self.run_id, self.pool)
            if p is None:
                return
            live_ids = {a.id for a in p.live}
            self._scancelled = {k: v for k, v in self._scancelled.items() if k in live_ids}
            self._out_of_router(p)
            to_cancel = self._due_for_scancel(p)
        if to_cancel:
            self._send_scancel(p, to_cancel)
        with self.lock:
            self.history.note(read_pool(self.store, self.run_id, self.pool))

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

    # -- shrink -----------------------------------------------------------------------------------
    def _drain(self, p: PoolSnapshot, surplus: int, now: float, why: str) -> None:
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

    def _out_of_router(self, p: PoolSnapshot) -> None:
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

    def _undrain(self, p: PoolSnapshot, count: int, now: float) -> int:
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
