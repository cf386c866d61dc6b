"""The simulated engines' router: which worker a waiting request goes to, and in what order each worker's
waiting queue admits them (``Router``, one per ``pearlctl.sim.engine.Engine``).

Two models (``ROUTERS``):

- ``consistent_hash`` (the default): the run's router, vllm-router's ``consistent_hash`` policy on the session id,
  as pearlctl/router/service.py starts it. A request goes to the worker its session hashes to on the ring of the
  routable workers, whatever the loads, and queues there (vLLM's per-worker waiting queue) even if the ring
  changes meanwhile, unless the gateway's rebalance at a join sends it again (``migration.rebalance``); a next
  turn therefore finds its KV unless the ring changed (a worker joined or left), and then re-prefills on its new
  worker. Running decodes move only in that rebalance.
- ``balance``: the model this simulator used before the run's router existed (one waiting queue; session
  affinity unless a worker runs ``BALANCE_ABS`` sequences above the mean; new prompts to the worker with the most
  free KV), kept to compare with earlier results.

Guarantees: both admit first come first served per worker, as far as its free slots and KV go (a request that
does not fit blocks those behind it); the ring (each session's hash, each worker's virtual nodes) is fixed for
the run, the same for every policy. Speed without a change of result: the consistent-hash queue persists
between admissions (a request is routed once, when it becomes ready, and put where a sort of all waiting
requests would put it); it is rebuilt when the engine's roles change or a batch is launched.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pearlctl.sim.trajectories import FEW, group_starts

# The router models (Engine's ``router``): the run's router (vllm-router's consistent_hash, Router.route_ring) and
# the load-balancing model this simulator used before the run's router existed (Router.route_balance).
ROUTERS = ("consistent_hash", "balance")
DEFAULT_ROUTER = "consistent_hash"
BALANCE_ABS = 32  # "balance": sequences above the mean load before a next turn is sent elsewhere
VIRTUAL_NODES = 160  # "consistent_hash": virtual nodes per worker on the ring (vllm-router's VIRTUAL_NODES_PER_WORKER)


class RoutedEngine(Protocol):
    """What the ``Router`` reads and writes of its engine (``pearlctl.sim.engine.Engine``): the window of
    trajectories in flight, the number of workers, and the trajectories' arrays routing reads (when each became
    ready, its context and the turn's decode left) and sets (the worker a request was sent to; ``balance``: KV it
    gives up on a worker it moves away from)."""

    lo: int
    hi: int
    w_role: np.ndarray
    ready_at: np.ndarray
    ctx: np.ndarray
    dec_left: np.ndarray
    disp_w: np.ndarray
    kv_w: np.ndarray
    kv_hold: np.ndarray


class Router:
    """The router model ``model`` for ``n`` trajectories on ``n_workers`` workers, and its routed waiting queue."""

    def __init__(self, model: str, n: int, n_workers: int):
        if model not in ROUTERS:
            raise ValueError(f"no router model {model!r}; known: {', '.join(ROUTERS)}")
        self.ring = model == "consistent_hash"
        # The hash ring: each session's hash and each worker's virtual nodes, fixed for the run (the same for
        # every policy); the ring of the routable workers is rebuilt when they change.
        self.session = np.random.default_rng(0x5E55).random(n)
        self.vnodes = np.random.default_rng(0x21A6).random((n_workers, VIRTUAL_NODES))
        self._ring: tuple[bytes, np.ndarray, np.ndarray] | None = None
        self._ring_at: tuple[bytes, int, int, np.ndarray] | None = None  # the ring's worker for trajectories lo..hi
        # consistent_hash: the routed waiting requests, kept in the order the queues serve them (their worker,
        # then ready_at, then index) from one admission to the next (rebuilt when the roles change)
        self._queue = np.zeros(0, np.intp)
        self._queue_ok = False
        self._queued = np.zeros(n, bool)
        self._arrived: list[np.ndarray] = []  # requests that became ready since the last admission (arrivals)
        self._need = np.zeros(n)  # a queued request's KV reservation (context + the turn's response)

    def reset(self, routable: np.ndarray | None = None) -> None:
        """The queue is routed again at the next admission: a batch was launched, or the roles changed (then
        ``routable``, the routable workers, tells whether the ring did)."""
        self._queue_ok = False
        self._arrived = []
        if routable is not None and self._ring_at is not None and self._ring_at[0] != routable.tobytes():
            self._ring_at = None

    def arrive(self, r: np.ndarray) -> None:
        """Requests ``r`` became ready (their tools returned)."""
        if self.ring:
            self._arrived.append(r)

    @property
    def kept(self) -> bool:
        """The routed queue is kept: only the requests that arrived since the last admission need routing."""
        return self._queue_ok

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing arrived."""
        return not self._arrived and not self._queue.size

    def route_balance(self, e: RoutedEngine, q, routable, load, slots, free_kv, need) -> np.ndarray:
        """The ``balance`` model (this simulator's before the run's router existed; no real router's rule):
        session affinity with load balance. A next turn goes back to the worker holding its KV unless that
        worker runs more than ``BALANCE_ABS`` sequences above the mean, in which case it goes elsewhere and
        re-prefills its context there; new prompts, and next turns whose KV is gone, go FIFO to the worker with
        the most free KV, and the first that fits nowhere blocks the queue behind it. A request waits in one
        queue until a worker admits it; running decodes never move. Returns each request's worker (-1: waits)."""
        n_w = len(e.w_role)
        admitted_w = np.full(q.size, -1, np.intp)
        slots, free_kv = slots.copy(), free_kv.copy()
        kw = e.kv_w[q]
        excess = np.where(routable, load - load[routable].mean(), 0.0)
        if (excess > BALANCE_ABS).any():
            moving = np.flatnonzero((kw >= 0) & (excess[np.maximum(kw, 0)] > BALANCE_ABS))
            if moving.size:
                moving = moving[np.lexsort((e.ready_at[q[moving]], kw[moving]))]
                w = kw[moving]
                rank = np.arange(w.size) - group_starts(w)
                moving = moving[rank < excess[w] - BALANCE_ABS]
                e.kv_w[q[moving]] = -1
                e.kv_hold[q[moving]] = 0.0
                kw = e.kv_w[q]

        # Sequences whose KV is on a routable worker go back to it (session affinity), FIFO per worker.
        res = np.flatnonzero((kw >= 0) & routable[np.maximum(kw, 0)])
        if res.size:
            order = res[np.lexsort((e.ready_at[q[res]], kw[res]))]
            w = kw[order]
            ok = _fits(w, need[order], slots, free_kv)
            admitted_w[order[ok]] = w[ok]
            slots -= np.bincount(w[ok], minlength=n_w)
            free_kv -= np.bincount(w[ok], need[order[ok]], n_w)

        rest = np.flatnonzero(admitted_w < 0)
        rest = rest[np.argsort(e.ready_at[q[rest]], kind="stable")]
        for j in rest:
            if kw[j] >= 0 and routable[kw[j]]:
                continue  # waits for its own worker
            cand = np.where(slots > 0, free_kv, -1.0)
            w = int(np.argmax(cand))
            if cand[w] < need[j]:
                break
            admitted_w[j] = w
            slots[w] -= 1
            free_kv[w] -= need[j]
        return admitted_w

    def route_ring(self, e: RoutedEngine, ready, routable, decode_w, slots, free_kv) -> tuple[np.ndarray, ...]:
        """vllm-router's ``consistent_hash`` policy, the one the run's router uses (pearlctl/router/service.py):
        a request goes to the worker its session hashes to on the ring of the routable workers (``VIRTUAL_NODES``
        virtual nodes each), whatever the loads, and queues there (vLLM's waiting queue, first come first
        served: the first that does not fit blocks the ones behind it) while that worker serves (``decode_w``) —
        even if the ring changes meanwhile (a queue the gateway rebalances at a join is routed again: the engine
        clears those requests' ``disp_w``). When a worker joins, the other sessions that now hash to it move at
        their next turn and re-prefill there; when one leaves, its sessions go to the ring's next owners. ``ready``: the
        window's ready waiting requests (a mask; None: those queued and the arrivals since). Returns the admitted
        requests (in index order), their workers and needs.

        The routed queue (``_queue``) persists between admissions: a request is routed once, when it becomes
        ready, and put in its place (by worker, ready_at, index: the order a sort of all of them would give)."""
        if ready is None:
            new = self._arrived[0] if len(self._arrived) == 1 else np.concatenate(self._arrived or [self._queue[:0]])
        elif self._queue_ok:
            new = (ready & ~self._queued[e.lo : e.hi]).nonzero()[0] + e.lo
        else:  # route every ready request again
            self._queued[self._queue] = False
            self._queue = self._queue[:0]
            self._queue_ok = True
            new = ready.nonzero()[0] + e.lo
        self._arrived = []
        if new.size:
            d = e.disp_w[new]
            if d.max() < 0:
                target = self.ring_owner(e, new, routable)
            else:
                target = np.where((d >= 0) & decode_w[np.maximum(d, 0)], d, self.ring_owner(e, new, routable))
            e.disp_w[new] = target
            self._need[new] = e.ctx[new] + e.dec_left[new]
            self._queued[new] = True
            if new.size > 1:
                by = np.lexsort((e.ready_at[new], target))
                new, target = new[by], target[by]
            self._enqueue(e, new, target)
        queue = self._queue
        if not queue.size:
            return queue, queue, queue
        w = e.disp_w[queue]
        ok = _fits(w, self._need[queue], slots, free_kv)
        sel = ok.nonzero()[0]
        if not sel.size:
            return sel, sel, sel
        self._queue = queue[~ok]
        i = queue[sel]
        self._queued[i] = False
        by = i.argsort()
        i = i[by]
        return i, w[sel][by], self._need[i]

    def _enqueue(self, e: RoutedEngine, new: np.ndarray, target: np.ndarray) -> None:
        """Put routed requests ``new`` (sorted by ``target``, then ready_at, then index) in their places in the
        queue: at the end of their worker's queue when they became ready after all of it (the usual case), else
        by sorting the whole queue again."""
        queue = self._queue
        if not queue.size:
            self._queue = new
            return
        w = e.disp_w[queue]
        end = w.searchsorted(target, side="right")
        if new.size <= FEW:
            ready_at = e.ready_at
            after = all(
                k == 0 or w.item(k - 1) != t or ready_at.item(queue.item(k - 1)) < ready_at.item(j)
                for k, t, j in zip(end.tolist(), target.tolist(), new.tolist(), strict=True)
            )
        else:
            last = queue[np.maximum(end - 1, 0)]
            after = (end == 0) | (w[np.maximum(end - 1, 0)] != target) | (e.ready_at[last] < e.ready_at[new])
            after = after.all()
        if not after:
            both = np.concatenate((queue, new))
            self._queue = both[np.lexsort((both, e.ready_at[both], e.disp_w[both]))]
            return
        pos = end + np.arange(new.size)
        merged = np.empty(queue.size + new.size, queue.dtype)
        merged[pos] = new
        old = np.empty(merged.size, bool)
        old.fill(True)
        old[pos] = False
        merged[old] = queue
        self._queue = merged

    def ring_owner(self, e: RoutedEngine, i: np.ndarray, routable: np.ndarray) -> np.ndarray:
        """The worker each session of trajectories ``i`` (in the window) hashes to on the ring of the ``routable``
        workers (looked up for the whole window at once, once per ring and window)."""
        at = self._ring_at
        if at is None or at[1] > e.lo or at[2] < e.hi:
            key = routable.tobytes()
            if self._ring is None or self._ring[0] != key:
                workers = np.flatnonzero(routable)
                pos = self.vnodes[workers].ravel()
                owner = np.repeat(workers, VIRTUAL_NODES)
                by = np.argsort(pos)
                self._ring = (key, pos[by], owner[by])
            _, pos, owner = self._ring
            at = (key, e.lo, e.hi, owner[pos.searchsorted(self.session[e.lo : e.hi]) % pos.size])
            self._ring_at = at
        return at[3][i - at[1]]


def _fits(w: np.ndarray, need: np.ndarray, slots: np.ndarray, free_kv: np.ndarray) -> np.ndarray:
    """For requests sorted by worker ``w`` (FIFO within each), which are admitted: first come first served
    per worker, as far as its free slots and KV go (a request that does not fit blocks those behind it)."""
    start = group_starts(w)  # where each request's worker's requests start
    cs = np.zeros(w.size + 1)  # cs[g]: the running total before position g
    np.add.accumulate(need, out=cs[1:])
    # rank within the worker's queue < its free slots; the running total of its queue (as a difference of
    # the running totals of the whole queue) within its free KV
    return (np.arange(w.size) < start + slots[w]) & (cs[1:] - cs[start] <= free_kv[w])
