"""Agent liveness: when each allocation's agent was last heard from, and the loss of a silent one.

An agent is heard on every request's arrival and answer (``arrived``, which the control API wraps every agent
request in), and alive all the while a request of its own waits. One silent for a loss window (``lost_after``
heartbeat intervals, at least ``MIN_LOSS_WINDOW_S``) has its GPUs and workers marked LOST (``check_agents``,
each tick) — but not before a daemon that just started gave agents its takeover grace to find it, and not for a
silence that was this daemon's own stall. Heard times are kept in memory and reach state (``agent_seen_at``) at
most every ``SEEN_WRITE_S``.
"""

from __future__ import annotations

import collections
import contextlib
import logging

from pearlctl.api import bodies
from pearlctl.daemon.shared import Side
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import WorkerState as W

log = logging.getLogger("pearlctl.daemon")

# Agents' heartbeat times reach state (``agent_seen_at``: status, a successor daemon, which gives agents a
# takeover grace anyway) at most this often; the loss check reads them from memory. At 512 agents a write
# every tick was a quarter of a tick that decided nothing (docs/benchmarks.md).
SEEN_WRITE_S = 5.0


def move_gpus(
    side: Side, alloc_id: int, from_states: tuple[G, ...], to: G, event: str, data: dict | None = None
) -> bool:
    """Every GPU of the allocation in one of ``from_states`` goes ``to`` (journaled, under ``side``'s epoch);
    whether any moved."""
    hit = False
    for g in side.store.fleet.gpus(side.run_id, allocation_id=alloc_id):
        if g.state in from_states:
            side.store.set_state("gpus", g.id, expect=g.state, to=to, epoch=side.epoch, event=event, data=data)
            hit = True
    return hit


class Liveness(Side):
    """When each agent was heard from, how long it may be silent, and the loss of those silent longer."""

    def __init__(self, shared) -> None:
        super().__init__(shared)
        # allocation -> when its agent was last heard from: the loss check reads it here; it reaches state (for
        # status and a successor daemon) at most every SEEN_WRITE_S in one transaction, not once per heartbeat
        self._seen: dict[int, float] = {}
        self._seen_written: dict[int, float] = {}
        self._seen_written_at: float | None = None
        self.in_flight: collections.Counter[int] = collections.Counter()  # allocation -> requests not answered
        self._grace_from = self.clock()  # agents are judged only ``takeover_grace_s`` after this (``published``)
        self._checked_at: float | None = None  # when check_agents last ran (a long gap: the daemon was held up)
        self._held_up = (0.0, 0.0)  # (until when, by how long) silence is forgiven after the daemon was held up

    def heard(self, allocation_id: int) -> None:
        """The allocation's agent was heard from just now (no lock: one dict assignment)."""
        self._seen[allocation_id] = self.clock()

    def heard_at(self, alloc) -> float | None:
        """When the allocation's (``alloc``, its row) agent was last heard from: this daemon's time in memory,
        else state's ``agent_seen_at``."""
        return self._seen.get(alloc.id, alloc.agent_seen_at)

    @contextlib.contextmanager
    def arrived(self, allocation_id: int):
        """An agent's request arrived (its credential proved who sent it) and is answered within: the agent is
        alive all the while, however long the request waits for a handler thread, the lock or a long poll's
        change — the control API wraps every agent request in it."""
        self.heard(allocation_id)
        self.in_flight[allocation_id] += 1
        try:
            yield
        finally:
            self.in_flight[allocation_id] -= 1
            self.heard(allocation_id)

    @property
    def loss_window_s(self) -> float:
        """How long an agent may be silent before its GPUs and workers are LOST: ``lost_after`` heartbeat
        intervals, but never under ``MIN_LOSS_WINDOW_S`` — at 10 Hz, two intervals are 0.2 s, less than a busy
        host's scheduling hiccup, and LOST must mean lost, not late."""
        return max(self.lost_after * self.heartbeat_s, bodies.MIN_LOSS_WINDOW_S)

    def published(self) -> None:
        """The daemon's address is in the run directory now: agents can find it from here on."""
        self._grace_from = self.clock()

    @property
    def takeover_grace_s(self) -> float:
        """How long a daemon that just started waits before it judges agents: one loss window from when its
        address was published, plus the heartbeat interval an agent waits between failed attempts."""
        return self.loss_window_s + self.heartbeat_s

    def check_agents(self) -> list[int]:
        """Mark GPUs and workers of silent agents LOST; returns the allocation ids marked.

        A daemon that just started gives agents ``takeover_grace_s`` to find it: their last heartbeat went
        to the daemon before, so its age says nothing yet (judging them at once would, after every restart,
        mark live workers LOST and plan around them — a parked worker passed over for a cold start). The
        time counts from the address's publication, not the controller's creation: before it, no agent can
        reach this daemon (the router's start or adoption comes first).

        A stall of the daemon itself is forgiven the same way: when this check comes more than half a loss
        window after the last one (a starved host, a long collection, a slow disk under a commit; no longer a
        policy decision, which is made with the decision lock released), the agents' heartbeats may have
        stalled with it, so for one loss window from then an agent may be silent that much longer. LOST means
        lost, not unheard by a daemon that was not listening; a dead agent is still found, a loss window plus
        the stall later."""
        with self.lock, self.store.atomic():  # facts only, no effect between them: one commit for all
            # heartbeats note their time without the lock: read a copy, never swap the dict under them
            now = self.clock()
            if self._seen_written_at is None or now - self._seen_written_at >= SEEN_WRITE_S:
                seen = {a: t for a, t in list(self._seen.items()) if t != self._seen_written.get(a)}
                self.store.fleet.record_agents_seen(self.run_id, seen, epoch=self.epoch)
                self._seen_written.update(seen)
                self._seen_written_at = now
            gap = 0.0 if self._checked_at is None else now - self._checked_at
            self._checked_at = now
            if gap > self.loss_window_s / 2:
                log.warning("agent loss checked %.1fs after the last check: their silence is forgiven that long", gap)
                self._held_up = (now + self.loss_window_s, gap)
            if now - self._grace_from < self.takeover_grace_s:
                return []
            until, held = self._held_up
            deadline = now - self.loss_window_s - (held if now < until else 0.0)
            marked = []
            workers: list[dict] | None = None  # read when an agent is found silent, not every tick
            # cached rows (no 512-row read per tick while nothing changed): their agent_seen_at may be older than
            # what was written since, or heard since, so the newer time in memory counts; None stays None (never
            # heard from, or reset by a requeue, which changes the rows and so the cache)
            for alloc in self.store.fleet.allocations(self.run_id, cached=True):
                seen = alloc.agent_seen_at
                if seen is not None:
                    seen = max(seen, self._seen.get(alloc.id, seen))
                gone = alloc.state in (A.ENDED, A.LOST)
                if seen is None or (not gone and (seen > deadline or self.in_flight[alloc.id] > 0)):
                    continue
                hit = move_gpus(self, alloc.id, (G.UP, G.DRAINING), G.LOST, "agent silent", {"last_seen": seen})
                workers = self.store.fleet.workers(self.run_id) if workers is None else workers
                for w in workers:
                    if w.allocation_id == alloc.id and w.state not in (W.STOPPED, W.FAILED, W.LOST):
                        self.store.set_state(
                            "workers",
                            w.id,
                            expect=w.state,
                            to=W.LOST,
                            epoch=self.epoch,
                            event="agent silent",
                            data={"last_seen": seen},
                        )
                        hit = True
                if hit:
                    marked.append(alloc.id)
            return marked
