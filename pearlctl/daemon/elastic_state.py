"""The elastic pool as state holds it: the snapshot every pass of the pool's driver (pearlctl.daemon.elastic)
reads under the decision lock, the size history those passes journal, and ``elastic_view``, what
``pearlctl status`` (and the daemon's ``GET /v1/status``) shows of both.

- **One snapshot per read.** ``read_pool`` returns the pool's row, its spec and its allocations in every state
  (``PoolSnapshot``); what counts as live, draining or serving, and the bounds ``[nodes, max_nodes]``, are
  derived from it in one place for the driver, its growth (pearlctl.daemon.elastic_grow) and the view.
- **Journaled, with a size history.** Each change of the pool's size or make-up is an ``elastic size`` event
  on the pool (size, running, pending, preempting, lost, draining, wanted), written by ``SizeHistory.note``
  only when it differs from the last one; ``elastic_view`` reads the newest ``HISTORY_LIMIT`` of them.
- **The view only reads.** ``elastic_view`` writes nothing and needs no daemon.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pearlctl.config import PoolSpec
from pearlctl.ops.launcher import pool_spec_of
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.store import Store
from pearlctl.vocabulary import PoolKind

POOL = PoolKind.ELASTIC
# Allocation states that hold a place in the pool (or wait for one).
LIVE = (A.REQUESTED, A.PENDING, A.RUNNING, A.PREEMPTING, A.LOST)
HISTORY_LIMIT = 100  # size-history entries elastic_view returns
SIZE_EVENT = "elastic size"
SIZE_KEYS = ("size", "running", "pending", "preempting", "lost", "draining", "wanted")


@dataclass
class PoolSnapshot:
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


def read_pool(store: Store, run_id: str, pool: str) -> PoolSnapshot | None:
    """The pool of the run named ``pool``, or None when the run has none."""
    row = next((p for p in store.runs.pools(run_id) if p["name"] == pool), None)
    if row is None:
        return None
    run = store.runs.get(run_id)
    allocs = [a for a in store.fleet.allocations(run_id) if a.pool_id == row["id"]]
    return PoolSnapshot(run, row, pool_spec_of(run, pool), allocs)


class SizeHistory:
    """The pool's size history as one driver writes it: ``note`` journals the pool's counts as an
    ``elastic size`` event when they changed since the last entry (the last one is read from the journal
    once, so a restarted daemon does not repeat it). Every entry carries the daemon's lease epoch."""

    def __init__(self, store: Store, run_id: str, *, epoch: int | None):
        self.store, self.run_id, self.epoch = store, run_id, epoch
        self._last: dict | None = None  # the last size-history entry (loaded from the journal)

    def note(self, p: PoolSnapshot | None) -> None:
        """Journal the pool's size and make-up when they changed since the last entry."""
        if p is None:
            return
        counts = p.counts()
        if self._last is None:
            last = self.store.journal.entity_events("pools", p.row["id"], [SIZE_EVENT], limit=1)
            self._last = {k: (last[0]["data"] or {}).get(k) for k in SIZE_KEYS} if last else {}
        if counts != self._last:
            self.store.journal_event(self.run_id, "pools", p.row["id"], SIZE_EVENT, data=counts, epoch=self.epoch)
            self._last = counts


def elastic_view(store: Store, run_id: str, *, pool: str = POOL, now: float | None = None) -> dict | None:
    """The elastic pool for ``status``: its bounds, the size wanted and now, its live tasks (pending,
    running, draining, ...) and its size history (the newest ``HISTORY_LIMIT`` entries). Reads state only;
    None when the run has no elastic pool."""
    p = read_pool(store, run_id, pool)
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
