"""The simulator's truth model of the rollout engines: what really happens to every trajectory, tick by tick.

Everything is vectorised with numpy over trajectories; one ``Engine`` holds every trajectory of the run
(``pearlctl.sim.trajectories``: their work drawn up front from the scenario, so each policy faces the same work;
the phases each goes through) and the engine workers (one per ``gpus_per_worker`` GPUs). The run loop
(``pearlctl.sim.run``) tells it which workers serve in which role; the engine never decides anything a policy
could. Its three parts: ``pearlctl.sim.routing`` (which worker a waiting request goes to, and the order its queue
admits them), ``pearlctl.sim.batching`` (how far a tick takes each running sequence's prefill and decode) and
``pearlctl.sim.migration`` (what becomes of the sequences of a worker that leaves, and of the queues a join
rebalances), each working on the engine through a protocol of its own module that lists what it reads and writes
of it (``RoutedEngine``, ``BatchedEngine``, ``MigratingEngine``); the engine itself keeps the trajectories' state
and moves them from phase to phase: launches, tool returns, admissions, the end of a prefill or a turn, evictions
and, through ``migration``, leaves.

What the model guarantees — it must not flatter any policy:

- **Continuous batching, capped.** A decode worker runs at most ``max_num_seqs`` sequences and reserves KV
  for each admitted one (context + the turn's response); sequences that do not fit wait, first come first
  served (head-of-line blocking, as vLLM's waiting queue).
- **KV eviction costs recompute.** A tool-waiting sequence keeps its KV on its worker while it fits; when
  admissions need the space, the least recently used are evicted, and an evicted sequence re-prefills its
  whole context when its tool returns.
- **Migration is abort and continue** (``pearlctl.sim.migration``), as the live system does it when a worker
  leaves (the run's gateway, pearlctl/router/gateway.py, continues an aborted turn on another worker from its
  token ids). A worker that leaves its role (return, retire, switch, preemption) loses its KV. On a *graceful*
  leave its running sequences are aborted and continued on another worker with every token they generated
  (prompt + generated so far, the rest of the turn's budget), ``ABORT_S`` later, and re-prefill that whole
  context there; tool-waiting sequences whose KV it held re-prefill their context on their next turn. On a *hard
  kill* (a preemption with no notice: nothing answers the abort) the running turn is retried from its start: the
  tokens generated in that turn are lost (``lost_tokens``) and the context as it was when the turn began is
  re-prefilled. A draining worker (``routable`` false: a preemption notice came) decodes what it runs but is
  sent nothing new; next turns whose KV it holds go elsewhere.
- **The router is the run's router** (``router="consistent_hash"``, the default; ``pearlctl.sim.routing``):
  vllm-router's ``consistent_hash`` policy on the session id; a next turn finds its KV unless the ring changed.
  ``router="balance"`` is the model this simulator used before the run's router existed, kept for comparison.
- **A join rebalances queues and imbalanced workers, as the gateway does** (``pearlctl.sim.migration.rebalance``;
  pearlctl/router/admin.py): when colocated workers join the ring, each older colocated worker with requests
  waiting in its queue, or imbalanced against the idlest routable worker by vllm-router's own test
  (``pearlctl.vocabulary.imbalanced``), has what it decodes and what waits there aborted and sent again through
  the router ``ABORT_S`` later; the sessions that now hash to a joined worker go there and re-prefill their
  context, the others return to their worker, whose prefix cache holds theirs. Other workers are left alone.
- **Decode grows less than linearly with batch, and prefill shares the worker in colocated mode**
  (``pearlctl.sim.batching``): the planner's own decode model; PREFILL workers and a KV transfer when
  disaggregated.
- **The truth may differ from the profile** (a model mismatch, ``Draws.decode_scale`` / ``prefill_scale``,
  tool latencies drawn longer: ``trajectories.with_mismatch``): each turn's decode iterations and prefill take
  that turn's factor times what the profile says. Policies never see these factors.
- **Transitions and weight syncs do no work.** A worker in transition is simply not in the role map; during a
  weight sync (``pause_until``) no worker prefills or decodes (tool calls, outside the engines, go on).

Fluid approximation: within a tick (``tick_s``) batch sizes are fixed; a turn's end time is exact (its
tool call starts then), but a tool's return is noticed at the next tick (on average ``tick_s / 2`` late —
the same for every policy). ``free_migration`` is the oracle's world: a worker that leaves hands its
sequences and their KV over at once, and a session's KV follows it wherever the router sends it (no abort
latency, no recompute, nothing lost); everything else identical.

Speed, not model: a tick works only on the window of trajectories in flight (``Engine.lo`` .. ``Engine.hi``:
launched and not all done) and skips what has nothing to do; the ``Engine`` doc lists the shortcuts, each of
which leaves every result bit for bit as it was.
"""

from __future__ import annotations

import numpy as np

from pearlctl.planner.profile import Profile
from pearlctl.sim import migration
from pearlctl.sim.batching import Batching
from pearlctl.sim.routing import DEFAULT_ROUTER, Router
from pearlctl.sim.trajectories import DECODE, DONE, FEW, PENDING, PREFILL, TOOL, WAIT, XFER, Draws, group_starts

# Worker roles as the engine sees them (OFF: not serving, or in transition).
W_OFF, W_ROLLOUT, W_PREFILL, W_DECODE = 0, 1, 2, 3


class Engine:
    """Trajectories and workers of one simulated run. ``launch`` a batch, set the worker roles, ``step``.

    Speed (every tick of every run comes here; none of this changes a result, bit for bit):

    - The window: each tick works on trajectories ``[lo, hi)``; those before ``lo`` are all DONE (``lo`` moves
      when one finishes), those from ``hi`` on PENDING.
    - Skips: arrivals before the earliest pending tool return or KV transfer (``_next_tool``, ``_next_xfer``:
      lower bounds, exact after each scan); admission when nothing changed since a call that admitted nothing
      (``_admit_dirty``: the consistent-hash admission is a pure function of the waiting requests, the running
      reservations and the roles) and no waiting request becomes ready (``_admit_wake``), or when none is
      queued and none arrived; prefill when no sequence prefills (``_prefilling``).
    - The consistent-hash queue persists (``pearlctl.sim.routing``): a request is routed and put in its place
      once, when it becomes ready; it is rebuilt when roles change or a batch is launched.
    - Invariants the scans rely on: ``run_w >= 0`` exactly while a sequence runs (PREFILL, XFER, DECODE);
      ``tool_end`` is finite exactly in TOOL, ``xfer_end`` exactly in XFER.
    - Few events (up to ``FEW`` arrivals, admissions, turn ends, colocated prefills in a tick) are handled
      element by element (``*_few``, ``end_turn``), where numpy's cost per call would dominate; the same
      arithmetic in the same order.
    - Sums keep their order: ``np.bincount`` in index order, running totals in queue order, numpy's own sums
      over the same arrays.
    """

    def __init__(
        self,
        profile: Profile,
        draws: Draws,
        n_workers: int,
        max_context: int,
        free_migration: bool = False,
        router: str = DEFAULT_ROUTER,
    ):
        self.router = Router(router, draws.n, n_workers)
        self.batching = Batching(profile)
        self.profile = profile
        self.draws = draws
        self.max_context = float(max_context)
        self.free_migration = free_migration
        n = draws.n
        self.phase = np.full(n, PENDING, np.int8)
        self.turn = np.zeros(n, np.intp)
        self.ctx = np.zeros(n)  # tokens the next decoded token attends to
        self.new_tok = np.zeros(n)  # tokens of the context not yet in any KV cache
        self.dec_left = np.zeros(n)
        self.dec_turn = np.zeros(n)  # the current turn's decode budget (a hard kill restarts the turn from it)
        self.pf_left = np.zeros(n)
        self.pf_total = np.zeros(n)  # tokens this admission prefills (KV transfer size when disaggregated)
        self.run_w = np.full(n, -1, np.intp)  # the worker it runs on (RUNNING phases; -1 otherwise)
        self.kv_w = np.full(n, -1, np.intp)  # the worker holding its KV, or -1
        self.kv_hold = np.zeros(n)  # KV tokens held on kv_w (running: the reservation)
        self.ready_at = np.zeros(n)  # FIFO order in the waiting queue
        self.tool_start = np.zeros(n)  # LRU order for eviction
        self.tool_end = np.full(n, np.inf)  # when its tool returns (TOOL only; inf otherwise)
        self.xfer_end = np.full(n, np.inf)  # when its KV transfer lands (XFER only; inf otherwise)
        self.done_at = np.full(n, np.nan)
        self.migrated = np.zeros(n, bool)  # free_migration: its KV followed it off a leaving worker
        self.orphaned = np.zeros(n, bool)  # its KV was lost to a leaving or draining worker
        self.disp_w = np.full(n, -1, np.intp)  # the worker a waiting request was sent to (it queues there)
        self.pause_until = 0.0
        self.lo = 0  # trajectories before lo are all DONE; those from hi on are PENDING
        self.hi = 0
        # What a tick may skip (the class doc).
        self._next_tool = np.inf
        self._next_xfer = np.inf
        self._admit_dirty = True
        self._admit_wake = np.inf
        self._prefilling = False  # some sequence may be in PREFILL
        # The mismatch factors of each trajectory's current turn (kept as its turn advances; read by ``batching``).
        ds, ps = draws.decode_scale, draws.prefill_scale
        self.dscale = None if ds is None else ds[:, 0].copy()
        self.pscale = None if ps is None else ps[:, 0].copy()
        self._finished = False  # some trajectory finished this tick: the window's lo may move
        self.w_role = np.zeros(n_workers, np.int8)
        self.w_admit = np.ones(n_workers, bool)  # routable: takes new requests (false: draining)
        self._roles_changed()
        self.stats = {"prefill_tokens": 0.0, "recompute_tokens": 0.0, "decode_tokens": 0.0, "evictions": 0}
        # requeued: sequences a leaving worker was running; of them aborted (continued, tokens kept) and
        # killed (hard kill: the turn retried, lost_tokens gone); leave_recompute_tokens: context re-prefilled
        # because a leaving or draining worker held its KV (included in recompute_tokens)
        self.stats |= {"requeued": 0, "aborted": 0, "killed": 0, "lost_tokens": 0.0, "leave_recompute_tokens": 0.0}
        # rebalanced: decoding sequences the gateway's rebalance at a join aborted and sent again; of them moved
        # to a joined worker (``migration.rebalance``)
        self.stats |= {"rebalanced": 0, "moved": 0}

    # -- control ----------------------------------------------------------------------------------

    def launch(self, lo: int, hi: int, t: float) -> None:
        """Make trajectories [lo, hi) ready: their prompts wait for a decode slot."""
        d = self.draws
        s = slice(lo, hi)
        self.phase[s] = WAIT
        self.ctx[s] = d.prompt[s]
        self.new_tok[s] = d.prompt[s]
        self.dec_left[s] = np.minimum(d.response[s, 0], self.max_context - d.prompt[s])
        self.dec_turn[s] = self.dec_left[s]
        self.ready_at[s] = t
        self.hi = max(self.hi, hi)
        self._admit_dirty = True
        self.router.reset()
        self._admit_wake = min(self._admit_wake, t)

    def set_roles(self, roles: np.ndarray, t: float = 0.0, *, routable=None, killed=None) -> None:
        """The workers' roles from ``t`` on (W_OFF while absent, in transition or stopped). A worker that leaves
        a serving role loses its KV and its running sequences go on elsewhere (the module doc's migration):
        continued with their tokens ``ABORT_S`` later, or — workers in ``killed`` (a boolean mask: a hard kill)
        — retried from the start of their turn. ``routable`` (a boolean mask, default every worker): the
        workers the router sends new requests to; one that is not decodes what it runs (a drain)."""
        roles = np.asarray(roles, np.int8)
        changed = np.flatnonzero((roles != self.w_role) & (self.w_role != W_OFF))
        if changed.size:
            hard = np.zeros(len(roles), bool) if killed is None else np.asarray(killed, bool)
            self._sent_again(migration.leave(self, changed, t, hard))
        was = self._routable & (self.w_role == W_ROLLOUT)
        self.w_role = roles.copy()
        self.w_admit = np.ones(len(roles), bool) if routable is None else np.asarray(routable, bool).copy()
        self._roles_changed()
        joined = self._routable & (roles == W_ROLLOUT) & ~was
        if self.router.ring and np.count_nonzero(joined) and np.count_nonzero(was & self._routable):
            self._sent_again(migration.rebalance(self, was & self._routable, t, self._routable))

    def _sent_again(self, at: float) -> None:
        """Requests a migration sent again become ready at ``at`` (``inf``: none waits): admission runs again."""
        self._admit_wake = min(self._admit_wake, at)
        self._admit_dirty = True

    def _roles_changed(self) -> None:
        """What the tick reads of the roles, kept until they change (``n_prefill`` and ``prefills_own``: by
        ``batching``)."""
        roles = self.w_role
        self._serving = bool((roles != W_OFF).any())
        self._decode_w = (roles == W_ROLLOUT) | (roles == W_DECODE)
        self._routable = self._decode_w & self.w_admit
        self._any_routable = bool(self._routable.any())
        self.n_prefill = int(((roles == W_PREFILL) & self.w_admit).sum())
        # A worker prefills its own sequences when it is colocated, or when no PREFILL worker exists.
        self.prefills_own = (roles == W_ROLLOUT) | ((roles == W_DECODE) & (self.n_prefill == 0))
        self._admit_dirty = True
        self.router.reset(self._routable)  # routes and rings may change

    # -- the tick -----------------------------------------------------------------------------------

    def step(self, t: float, dt: float) -> None:
        """Advance every trajectory from ``t`` to ``t + dt``."""
        if self.lo >= self.hi:
            return
        if t >= self._next_xfer or t >= self._next_tool:
            self._arrivals(t)
        start = min(max(self.pause_until - t, 0.0), dt)  # a weight sync holds the engines
        avail = dt - start
        if avail > 0 and self._serving:
            if self._admit(t + start):
                self._evict_for_capacity()  # only an admission can push a worker over its KV capacity
            if self._prefilling:
                p_time, self._prefilling = self.batching.prefill(self, t + start, avail)
            else:
                p_time = np.zeros(len(self.w_role))
            self.batching.decode(self, t + start, avail, p_time)
        if self._finished:
            # Trajectories before lo are all done: shrink the window the next tick works on.
            self._finished = False
            tail = self.phase[self.lo : self.hi] != DONE
            self.lo += int(tail.argmax()) if np.count_nonzero(tail) else self.hi - self.lo

    def _arrivals(self, t: float) -> None:
        s = slice(self.lo, self.hi)
        if t >= self._next_xfer:
            # KV transfers that have landed: the decode worker takes the sequence into its batch.
            x = (self.xfer_end[s] <= t).nonzero()[0] + self.lo
            self.phase[x] = DECODE
            self.xfer_end[x] = np.inf
            self._next_xfer = float(self.xfer_end[s].min())
        if t < self._next_tool:
            return
        # Tools that have returned: the next turn is ready (its tool output joins the context).
        r = (self.tool_end[s] <= t).nonzero()[0]
        if not r.size:
            self._next_tool = float(self.tool_end[s].min())
            return
        r += self.lo
        if r.size <= FEW:
            self._arrived_few(r, s)
            return
        d = self.draws
        k = self.turn[r]
        ctx = self.ctx[r]
        out = np.minimum(d.tool_output[r, k], np.maximum(self.max_context - ctx, 0.0))
        ctx = ctx + out
        self.ctx[r] = ctx
        self.new_tok[r] = out
        k = k + 1
        self.turn[r] = k
        if self.dscale is not None:
            self.dscale[r] = d.decode_scale[r, k]
        if self.pscale is not None:
            self.pscale[r] = d.prefill_scale[r, np.minimum(k, d.prefill_scale.shape[1] - 1)]
        left = np.minimum(d.response[r, k], self.max_context - ctx)
        self.dec_left[r] = left
        self.dec_turn[r] = left
        end = self.tool_end[r]
        self.tool_end[r] = np.inf
        self._next_tool = float(self.tool_end[s].min())
        full = left < 1.0  # the context is full: the trajectory ends here
        if np.count_nonzero(full):
            self._finish(r[full], end[full])
            keep = ~full
            r, end = r[keep], end[keep]
        if r.size:
            self.phase[r] = WAIT
            self.ready_at[r] = end
            self._admit_dirty = True
            self.router.arrive(r)

    def _arrived_few(self, r: np.ndarray, s: slice) -> None:
        """``_arrivals``' tools returned for a few trajectories ``r``, element by element (the same arithmetic)."""
        d = self.draws
        top = self.max_context
        last = d.response.shape[1] - 1
        waiting = []
        for i in r.tolist():
            k = self.turn.item(i)
            ctx = self.ctx.item(i)
            out = min(d.tool_output.item(i, k), max(top - ctx, 0.0))
            ctx = ctx + out
            self.ctx[i] = ctx
            self.new_tok[i] = out
            k += 1
            self.turn[i] = k
            if self.dscale is not None:
                self.dscale[i] = d.decode_scale[i, k]
            if self.pscale is not None:
                self.pscale[i] = d.prefill_scale[i, min(k, last)]
            left = min(d.response.item(i, k), top - ctx)
            self.dec_left[i] = left
            self.dec_turn[i] = left
            end = self.tool_end.item(i)
            self.tool_end[i] = np.inf
            if left < 1.0:  # the context is full: the trajectory ends here
                self._finish_one(i, end)
            else:
                self.phase[i] = WAIT
                self.ready_at[i] = end
                waiting.append(i)
        self._next_tool = float(self.tool_end[s].min())
        if waiting:
            self._admit_dirty = True
            self.router.arrive(np.array(waiting, np.intp))

    def _admit(self, now: float) -> int:
        """Route the requests waiting since ``now`` or earlier and give each a decode slot and a KV reservation
        on its worker; how many were admitted."""
        if not self._any_routable:
            return 0
        ring = self.router.ring
        if ring and not self._admit_dirty and now + 1e-9 < self._admit_wake:
            return 0  # nothing changed since a call that admitted nothing: it would admit nothing again
        self._admit_dirty = False
        s = slice(self.lo, self.hi)
        if ring and self.router.kept and now + 1e-9 < self._admit_wake:
            ready = None  # the requests that became ready since the last admission are the arrivals'
            if self.router.idle:
                return 0  # nothing queued, nothing arrived: nothing to admit
        else:
            ph = self.phase[s]
            ready_at = self.ready_at[s]
            waiting = ph == WAIT
            ready = ready_at <= now + 1e-9
            if self._admit_wake <= now + 1e-9:  # the next request to become ready
                later = waiting & ~ready
                self._admit_wake = float(ready_at[later].min()) if np.count_nonzero(later) else np.inf
            ready &= waiting
        prof = self.profile
        n_w = len(self.w_role)
        routable = self._routable
        # run_w >= 0 exactly for the running sequences (bin 0 collects the rest): their loads and reservations.
        rw = self.run_w[s] + 1
        load = np.bincount(rw, minlength=n_w + 1)[1:]
        slots = np.where(routable, prof.max_num_seqs - load, 0)
        # Admission counts only running reservations: tool-waiting KV is evictable (see _evict_for_capacity).
        free_kv = np.where(routable, prof.kv_capacity_tokens - np.bincount(rw, self.kv_hold[s], n_w + 1)[1:], -1.0)
        if ring:
            i, w, need = self.router.route_ring(self, ready, routable, self._decode_w, slots, free_kv)
            if not i.size:
                return 0
        else:
            q = ready.nonzero()[0]
            if not q.size:
                return 0
            q += self.lo
            need = self.ctx[q] + self.dec_left[q]
            admitted_w = self.router.route_balance(self, q, routable, load, slots, free_kv, need)
            a = (admitted_w >= 0).nonzero()[0]
            if not a.size:
                return 0
            i, w, need = q[a], admitted_w[a], need[a]

        self._admit_dirty = True
        self._prefilling = True
        if i.size <= FEW:
            self._admitted_few(i, w, need, ring)
            return int(i.size)
        kv = self.kv_w[i]
        resident = (kv == w) | self.migrated[i]
        if self.free_migration and ring:
            resident |= kv >= 0  # the oracle's world: a session's KV follows it wherever the ring sends it
        new = self.new_tok[i]
        pf = np.where(resident, new, self.ctx[i])
        recompute = pf - new
        self.stats["recompute_tokens"] += float(recompute.sum())
        left = self.orphaned[i] | ((kv >= 0) & ~routable[np.maximum(kv, 0)])
        if np.count_nonzero(left):
            self.stats["leave_recompute_tokens"] += float(recompute[left].sum())
        self.phase[i] = PREFILL
        self.run_w[i] = w
        self.kv_w[i] = w
        self.kv_hold[i] = need
        self.pf_left[i] = pf
        self.pf_total[i] = pf
        self.migrated[i] = False
        self.orphaned[i] = False
        self.disp_w[i] = -1
        return int(i.size)

    def _admitted_few(self, i: np.ndarray, w: np.ndarray, need: np.ndarray, ring: bool) -> None:
        """``_admit``'s bookkeeping for a few admitted requests ``i`` (in index order), element by element: the
        same values as its vector form (the recompute sums are numpy's, over the same arrays)."""
        follows = self.free_migration and ring
        recompute, lost = [], []
        for j, k, x in zip(i.tolist(), w.tolist(), need.tolist(), strict=True):
            kv = self.kv_w.item(j)
            new = self.new_tok.item(j)
            pf = new if kv == k or self.migrated.item(j) or (follows and kv >= 0) else self.ctx.item(j)
            recompute.append(pf - new)
            if self.orphaned.item(j) or (kv >= 0 and not self._routable.item(kv)):
                lost.append(pf - new)
            self.phase[j] = PREFILL
            self.run_w[j] = k
            self.kv_w[j] = k
            self.kv_hold[j] = x
            self.pf_left[j] = pf
            self.pf_total[j] = pf
            self.migrated[j] = False
            self.orphaned[j] = False
            self.disp_w[j] = -1
        if any(recompute):  # (a sum of zeros adds nothing)
            self.stats["recompute_tokens"] += float(np.add.reduce(np.array(recompute)))
        if lost:
            self.stats["leave_recompute_tokens"] += float(np.add.reduce(np.array(lost)))

    def _evict_for_capacity(self) -> None:
        """Evict the least recently used idle KV (tool-waiting or queued sequences) where a worker is over
        capacity; those sequences will re-prefill their whole context."""
        s = slice(self.lo, self.hi)
        n_w = len(self.w_role)
        kv_w1 = self.kv_w[s] + 1  # bin 0: no KV held
        over = np.bincount(kv_w1, self.kv_hold[s], n_w + 1)[1:] - self.profile.kv_capacity_tokens
        is_over = over > 0
        if not np.count_nonzero(is_over):
            return
        # idle KV (tool-waiting or queued): held by a sequence not running (run_w < 0; one DONE or PENDING holds none)
        cand = ((self.run_w[s] < 0) & np.concatenate(([False], is_over))[kv_w1]).nonzero()[0]
        if not cand.size:
            return
        cand += self.lo
        w = self.kv_w[cand]
        by = np.lexsort((self.tool_start[cand], w))
        cand, w = cand[by], w[by]
        hold = self.kv_hold[cand]
        cs = np.zeros(cand.size + 1)
        np.add.accumulate(hold, out=cs[1:])
        before = cs[1:] - hold - cs[group_starts(w)]
        ev = cand[before < over[w]]
        self.kv_w[ev] = -1
        self.kv_hold[ev] = 0.0
        self.stats["evictions"] += int(ev.size)

    # -- the end of a prefill or a turn (``pearlctl.sim.batching`` tells when) ------------------------------

    def prefilled(self, i) -> None:
        """Trajectories ``i`` (an index or indices) prefilled on their decode worker: they decode now."""
        self.phase[i] = DECODE
        self.new_tok[i] = 0.0

    def transfer(self, i: np.ndarray, until: np.ndarray) -> None:
        """Trajectories ``i`` prefilled on a PREFILL worker: their KV crosses to the decode worker ``until`` then."""
        self.phase[i] = XFER
        self.new_tok[i] = 0.0
        self.xfer_end[i] = until
        self._next_xfer = min(self._next_xfer, float(until.min()))

    def end_turns(self, i: np.ndarray, end: np.ndarray) -> None:
        """Trajectories ``i`` decoded their turn's response at ``end``: each ends its trajectory (its last turn, or
        its context full) or starts its tool call."""
        self._admit_dirty = True  # slots and KV reservations free up
        turn = self.turn[i]
        last = (turn + 1 >= self.draws.turns[i]) | (self.ctx[i] >= self.max_context - 1)
        if np.count_nonzero(last):
            self._finish(i[last], end[last])
            more = ~last
            i, end, turn = i[more], end[more], turn[more]
            if not i.size:
                return
        self.phase[i] = TOOL
        self.run_w[i] = -1
        self.kv_hold[i] = self.ctx[i]  # the reservation shrinks to the context it keeps
        self.tool_start[i] = end
        tool_end = end + self.draws.tool_latency[i, turn]
        self.tool_end[i] = tool_end
        self._next_tool = min(self._next_tool, float(tool_end.min()))

    def end_turn(self, i: int, end: float) -> None:
        """``end_turns`` for one trajectory, element by element (the same arithmetic)."""
        self._admit_dirty = True  # slots and KV reservations free up
        turn = self.turn.item(i)
        c = self.ctx.item(i)
        if turn + 1 >= self.draws.turns.item(i) or c >= self.max_context - 1:
            self._finish_one(i, end)
            return
        self.phase[i] = TOOL
        self.run_w[i] = -1
        self.kv_hold[i] = c  # the reservation shrinks to the context it keeps
        self.tool_start[i] = end
        tool_end = end + self.draws.tool_latency.item(i, turn)
        self.tool_end[i] = tool_end
        self._next_tool = min(self._next_tool, tool_end)

    def _finish_one(self, i: int, at: float) -> None:
        self.phase[i] = DONE
        self.done_at[i] = at
        self.run_w[i] = -1
        self.kv_w[i] = -1
        self.kv_hold[i] = 0.0
        self._finished = True

    def _finish(self, i: np.ndarray, at) -> None:
        self.phase[i] = DONE
        self.done_at[i] = at
        self.run_w[i] = -1
        self.kv_w[i] = -1
        self.kv_hold[i] = 0.0
        self._finished = True

    # -- what the run loop reads --------------------------------------------------------------------

    def all_done(self, lo: int, hi: int) -> bool:
        if hi <= self.lo:
            return True  # before the window: all done
        if lo <= self.lo < hi and self.lo < self.hi:
            return False  # the window's first trajectory is not done
        return bool((self.phase[lo:hi] == DONE).all())

    def remaining_decode_tokens(self, lo: int, hi: int) -> float:
        """The true decode work left in trajectories [lo, hi) (the oracle may know it; policies never do)."""
        d = self.draws
        ph = self.phase[lo:hi]
        live = ph != DONE
        turns_idx = np.arange(d.response.shape[1])
        future = turns_idx[None, :] > self.turn[lo:hi, None]
        future &= turns_idx[None, :] < d.turns[lo:hi, None]
        return float(self.dec_left[lo:hi][live].sum() + (d.response[lo:hi] * future)[live].sum())

    def slowest_tools(self, lo: int, hi: int) -> float | None:
        """What a rollout driver timing its tool calls reports of finished trajectories [lo, hi): the largest sum
        of tool seconds over them (as drawn, mismatch included); None when they called no tool. A trajectory's
        calls are its turns but its last (``turn``: the calls returned)."""
        calls = self.turn[lo:hi]
        if not calls.any():
            return None
        taken = np.arange(self.draws.tool_latency.shape[1])[None, :] < calls[:, None]
        sums = (self.draws.tool_latency[lo:hi] * taken).sum(axis=1, dtype=np.float64)
        return float(sums.max())

    def busy(self) -> bool:
        """Some launched trajectory is unfinished (``in_flight`` is not empty)."""
        if self.lo >= self.hi:
            return False
        if self.phase[self.lo] != PENDING:
            return True  # the window's first trajectory is in flight (it is not done)
        ph = self.phase[self.lo : self.hi]
        return bool(np.count_nonzero((ph != DONE) & (ph != PENDING)))

    def in_flight(self) -> np.ndarray:
        """Indices of launched, unfinished trajectories."""
        ph = self.phase[self.lo : self.hi]
        return ((ph != DONE) & (ph != PENDING)).nonzero()[0] + self.lo
