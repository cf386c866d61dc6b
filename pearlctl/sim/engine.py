"""The simulator's truth model of the rollout engines: what really happens to every trajectory, tick by tick.

Everything is vectorised with numpy over trajectories; one ``Engine`` holds every trajectory of the run
(drawn up front from the scenario, so each policy faces the same work) and the engine workers (one per
``gpus_per_worker`` GPUs). The run loop (``pearlctl.sim.run``) tells it which workers serve in which role;
the engine never decides anything a policy could.

A trajectory is a chain of turns: prefill the new tokens (the prompt, then each tool's output), decode the
turn's response, wait on a tool, repeat. Phases: PENDING (its batch not launched) → WAIT (ready, needs a
decode slot) → PREFILL → [XFER: KV transfer to a decode worker, disaggregated only] → DECODE → TOOL → WAIT …
→ DONE.

What the model guarantees — it must not flatter any policy:

- **Continuous batching, capped.** A decode worker runs at most ``max_num_seqs`` sequences and reserves KV
  for each admitted one (context + the turn's response); sequences that do not fit wait, first come first
  served (head-of-line blocking, as vLLM's waiting queue).
- **KV eviction costs recompute.** A tool-waiting sequence keeps its KV on its worker while it fits; when
  admissions need the space, the least recently used are evicted, and an evicted sequence re-prefills its
  whole context when its tool returns.
- **Migration is abort and continue**, as the live system does it when a worker leaves (the run's gateway,
  pearlctl/router/gateway.py, continues an aborted turn on another worker from its token ids). A worker that
  leaves its role (return, retire, switch, preemption) loses its KV. On a *graceful* leave its running
  sequences are aborted and continued on another worker with every token they generated (prompt + generated
  so far, the rest of the turn's budget), ``ABORT_S`` later, and re-prefill that whole context there;
  tool-waiting sequences whose KV it held re-prefill their context on their next turn. On a *hard kill* (a
  preemption with no notice: nothing answers the abort) the running turn is retried from its start: the
  tokens generated in that turn are lost (``lost_tokens``) and the context as it was when the turn began is
  re-prefilled. A draining worker (``routable`` false: a preemption notice came) decodes what it runs but
  is sent nothing new; next turns whose KV it holds go elsewhere.
- **The router is the run's router** (``router="consistent_hash"``, the default): vllm-router's
  ``consistent_hash`` policy on the session id, as pearlctl/router/service.py starts it. A request goes to the
  worker its session hashes to on the ring of the routable workers, whatever the loads, and queues there
  (vLLM's per-worker waiting queue) even if the ring changes meanwhile; a next turn therefore finds its KV
  unless the ring changed (a worker joined or left), and then re-prefills on its new worker. Running
  decodes never move. ``router="balance"`` is the model this simulator used before the run's router existed
  (one waiting queue; session affinity unless a worker runs ``BALANCE_ABS`` sequences above the mean; new
  prompts to the worker with the most free KV), kept to compare with earlier results.
- **Decode grows less than linearly with batch.** Each iteration of a worker's batch takes
  ``profile.decode.itl(B, mean context)`` — the planner's own formula and numbers, so a dense model's
  throughput saturates with KV reads and an MoE's with the experts the batch touches. A lone straggler
  decodes at ``1 / itl(1, L)`` tokens/s: no configuration can finish it faster.
- **Prefill shares the worker in colocated mode.** A ROLLOUT worker first spends its tick on the prefill queue
  (at ``prefill_tok_s``), and only the rest of the tick decodes: prefill interferes with decode. In
  disaggregated mode PREFILL workers serve one shared FIFO, then the KV crosses at ``kv_transfer_gb_s``
  before the DECODE worker picks the sequence up.
- **The truth may differ from the profile** (a model mismatch, ``Draws.decode_scale`` / ``prefill_scale``,
  tool latencies drawn longer: ``with_mismatch``): each turn's decode iterations and prefill take that turn's
  factor times what the profile says. Policies never see these factors.
- **Transitions and weight syncs do no work.** A worker in transition is simply not in the role map; during a
  weight sync (``pause_until``) no worker prefills or decodes (tool calls, outside the engines, go on).

Fluid approximation: within a tick (``tick_s``) batch sizes are fixed; a turn's end time is exact (its
tool call starts then), but a tool's return is noticed at the next tick (on average ``tick_s / 2`` late —
the same for every policy). ``free_migration`` is the oracle's world: a worker that leaves hands its
sequences and their KV over at once, and a session's KV follows it wherever the router sends it (no abort
latency, no recompute, nothing lost); everything else identical.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pearlctl.planner.profile import Profile
from pearlctl.sim.scenario import Mismatch, Workload

# Trajectory phases.
PENDING, WAIT, PREFILL, XFER, DECODE, TOOL, DONE = range(7)
RUNNING = (PREFILL, XFER, DECODE)  # hold a batch slot and a KV reservation on their worker (contiguous codes)

# The router models (Engine's ``router``): the run's router (vllm-router's consistent_hash, _route_ring) and the
# load-balancing model this simulator used before the run's router existed (_route_balance), kept for comparison.
ROUTERS = ("consistent_hash", "balance")
DEFAULT_ROUTER = "consistent_hash"
BALANCE_ABS = 32  # "balance": sequences above the mean load before a next turn is sent elsewhere
VIRTUAL_NODES = 160  # "consistent_hash": virtual nodes per worker on the ring (vllm-router's VIRTUAL_NODES_PER_WORKER)
# ASSUMPTION (not measured): from a leave to its sequences' continuation on another worker — the
# deregistration reaching the router (a daemon tick, 0.5 s), the abort and its answers, the new requests.
# A leaving GPU starts its own transition (sleep, stop, switch) only after it too.
ABORT_S = 1.0

# Worker roles as the engine sees them (OFF: not serving, or in transition).
W_OFF, W_ROLLOUT, W_PREFILL, W_DECODE = 0, 1, 2, 3


@dataclass(frozen=True)
class Draws:
    """Every trajectory's work, drawn once per run (read-only; shared by engine clones)."""

    turns: np.ndarray  # int, >= 1
    prompt: np.ndarray  # tokens
    response: np.ndarray  # [N, max_turns] tokens generated per turn
    tool_output: np.ndarray  # [N, max_turns] tokens each tool returns
    tool_latency: np.ndarray  # [N, max_turns] seconds
    # Model mismatch (pearlctl.sim.scenario.Mismatch): per turn, how much longer than the profile says its decode
    # iterations and its prefill really take (None: exactly as the profile says).
    decode_scale: np.ndarray | None = None  # [N, max_turns]
    prefill_scale: np.ndarray | None = None  # [N, max_turns]

    @property
    def n(self) -> int:
        return len(self.turns)


def draw(workload: Workload, n: int, rng: np.random.Generator) -> Draws:
    turns = np.maximum(1, np.rint(workload.turns.sample(rng, n))).astype(np.int32)
    t_max = int(turns.max())
    cap = float(workload.max_context_tokens)
    return Draws(
        turns=turns,
        prompt=np.minimum(np.rint(workload.prompt_tokens.sample(rng, n)), cap / 2).clip(1),
        response=np.rint(workload.response_tokens.sample(rng, (n, t_max))).clip(1).astype(np.float32),
        tool_output=np.rint(workload.tool_output_tokens.sample(rng, (n, t_max))).clip(0).astype(np.float32),
        tool_latency=workload.tool_latency_s.sample(rng, (n, t_max)).astype(np.float32),
    )


def with_mismatch(draws: Draws, mismatch: Mismatch, rng: np.random.Generator) -> Draws:
    """The true work under ``mismatch``: tool calls take ``bias`` x a per-call factor longer than drawn, and
    each turn's decode and prefill get their factors (the engine applies them). The workload's own draws are
    unchanged, so runs with and without a mismatch face the same trajectories."""
    if mismatch.zero:
        return draws
    shape = draws.response.shape
    decode = mismatch.decode.factors(rng, shape).astype(np.float32)
    prefill = mismatch.prefill.factors(rng, shape).astype(np.float32)
    tool = mismatch.tool_latency.factors(rng, shape).astype(np.float32)
    return replace(
        draws,
        tool_latency=draws.tool_latency * tool,
        decode_scale=None if mismatch.decode.zero else decode,
        prefill_scale=None if mismatch.prefill.zero else prefill,
    )


class Engine:
    """Trajectories and workers of one simulated run. ``launch`` a batch, set the worker roles, ``step``."""

    def __init__(
        self,
        profile: Profile,
        draws: Draws,
        n_workers: int,
        max_context: int,
        free_migration: bool = False,
        router: str = DEFAULT_ROUTER,
    ):
        if router not in ROUTERS:
            raise ValueError(f"no router model {router!r}; known: {', '.join(ROUTERS)}")
        self.router = router
        self.profile = profile
        self.draws = draws
        self.max_context = float(max_context)
        self.free_migration = free_migration
        n = draws.n
        self.phase = np.full(n, PENDING, np.int8)
        self.turn = np.zeros(n, np.int32)
        self.ctx = np.zeros(n)  # tokens the next decoded token attends to
        self.new_tok = np.zeros(n)  # tokens of the context not yet in any KV cache
        self.dec_left = np.zeros(n)
        self.dec_turn = np.zeros(n)  # the current turn's decode budget (a hard kill restarts the turn from it)
        self.pf_left = np.zeros(n)
        self.pf_total = np.zeros(n)  # tokens this admission prefills (KV transfer size when disaggregated)
        self.run_w = np.full(n, -1, np.int32)  # the worker it runs on (RUNNING phases)
        self.kv_w = np.full(n, -1, np.int32)  # the worker holding its KV, or -1
        self.kv_hold = np.zeros(n)  # KV tokens held on kv_w (running: the reservation)
        self.ready_at = np.zeros(n)  # FIFO order in the waiting queue
        self.tool_start = np.zeros(n)  # LRU order for eviction
        self.tool_end = np.full(n, np.inf)
        self.xfer_end = np.full(n, np.inf)
        self.done_at = np.full(n, np.nan)
        self.migrated = np.zeros(n, bool)  # free_migration: its KV followed it off a leaving worker
        self.orphaned = np.zeros(n, bool)  # its KV was lost to a leaving or draining worker
        self.w_role = np.zeros(n_workers, np.int8)
        self.w_admit = np.ones(n_workers, bool)  # routable: takes new requests (false: draining)
        self.disp_w = np.full(n, -1, np.int32)  # the worker a waiting request was sent to (it queues there)
        # The router's hash ring: each session's hash and each worker's virtual nodes, fixed for the run (the
        # same for every policy); the ring of the routable workers is rebuilt when they change.
        self.session = np.random.default_rng(0x5E55).random(n)
        self.vnodes = np.random.default_rng(0x21A6).random((n_workers, VIRTUAL_NODES))
        self._ring: tuple[bytes, np.ndarray, np.ndarray] | None = None
        self.pause_until = 0.0
        self.lo = 0  # trajectories before lo are all DONE; those from hi on are PENDING
        self.hi = 0
        self.stats = {"prefill_tokens": 0.0, "recompute_tokens": 0.0, "decode_tokens": 0.0, "evictions": 0}
        # requeued: sequences a leaving worker was running; of them aborted (continued, tokens kept) and
        # killed (hard kill: the turn retried, lost_tokens gone); leave_recompute_tokens: context re-prefilled
        # because a leaving or draining worker held its KV (included in recompute_tokens)
        self.stats |= {"requeued": 0, "aborted": 0, "killed": 0, "lost_tokens": 0.0, "leave_recompute_tokens": 0.0}

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
            self._evict_workers(changed, t, hard)
        self.w_role = roles.copy()
        self.w_admit = np.ones(len(roles), bool) if routable is None else np.asarray(routable, bool).copy()

    def _evict_workers(self, workers: np.ndarray, t: float, hard: np.ndarray) -> None:
        s = slice(self.lo, self.hi)
        gone = np.zeros(len(self.w_role), bool)
        gone[workers] = True
        ph, run_w, kv_w = self.phase[s], self.run_w[s], self.kv_w[s]
        running = (ph >= PREFILL) & (ph <= DECODE) & (run_w >= 0)
        running &= gone[np.maximum(run_w, 0)]
        holding = (kv_w >= 0) & gone[np.maximum(kv_w, 0)]
        idx = np.flatnonzero(running) + self.lo
        held = np.flatnonzero(holding) + self.lo
        # requests queued at a leaving worker are aborted too (nothing generated): sent again through the router
        queued = np.flatnonzero((ph == WAIT) & (self.disp_w[s] >= 0) & gone[np.maximum(self.disp_w[s], 0)])
        queued += self.lo
        self.disp_w[queued] = -1
        self.stats["requeued"] += int(idx.size)
        if self.free_migration:
            # The oracle's world: the sequences and their KV move at once; nothing is aborted or lost.
            self.phase[idx] = WAIT
            self.run_w[idx] = -1
            self.migrated[held] = True
            self.kv_w[held] = -1
            self.kv_hold[held] = 0.0
            return
        # Hard kill: the turn is retried from its start (its generated tokens are lost; a sequence still in
        # prefill or in a KV transfer has generated none). Graceful: the continuation keeps them all (ctx).
        killed = idx[hard[self.run_w[idx]]]
        if killed.size:
            lost = self.dec_turn[killed] - self.dec_left[killed]
            self.ctx[killed] -= lost
            self.dec_left[killed] = self.dec_turn[killed]
            self.stats["lost_tokens"] += float(lost.sum())
        self.stats["killed"] += int(killed.size)
        self.stats["aborted"] += int(idx.size - killed.size)
        # A sequence whose prefill had not finished still owes its new tokens; the rest is re-prefilled too.
        self.phase[idx] = WAIT
        self.run_w[idx] = -1
        self.ready_at[idx] = t + ABORT_S  # a new request, behind those already waiting
        self.ready_at[queued] = np.maximum(self.ready_at[queued], t + ABORT_S)
        self.orphaned[held] = True
        self.kv_w[held] = -1
        self.kv_hold[held] = 0.0

    # -- the tick -----------------------------------------------------------------------------------

    def step(self, t: float, dt: float) -> None:
        """Advance every trajectory from ``t`` to ``t + dt``."""
        if self.lo >= self.hi:
            return
        self._arrivals(t)
        start = min(max(self.pause_until - t, 0.0), dt)  # a weight sync holds the engines
        avail = dt - start
        if avail > 0 and (self.w_role != W_OFF).any():
            if self._admit(t + start):
                self._evict_for_capacity()  # only an admission can push a worker over its KV capacity
            p_time = self._prefill(t + start, avail)
            self._decode(t + start, avail, p_time)
        # Trajectories before lo are all done: shrink the window the next tick works on.
        tail = self.phase[self.lo : self.hi] != DONE
        self.lo += int(np.argmax(tail)) if tail.any() else self.hi - self.lo

    def _arrivals(self, t: float) -> None:
        s = slice(self.lo, self.hi)
        ph = self.phase[s]
        # KV transfers that have landed: the decode worker takes the sequence into its batch.
        x = np.flatnonzero((ph == XFER) & (self.xfer_end[s] <= t)) + self.lo
        self.phase[x] = DECODE
        # Tools that have returned: the next turn is ready (its tool output joins the context).
        r = np.flatnonzero((ph == TOOL) & (self.tool_end[s] <= t)) + self.lo
        if not r.size:
            return
        d = self.draws
        k = self.turn[r]
        out = np.minimum(d.tool_output[r, k], np.maximum(self.max_context - self.ctx[r], 0.0))
        self.ctx[r] += out
        self.new_tok[r] = out
        self.turn[r] = k + 1
        self.dec_left[r] = np.minimum(d.response[r, k + 1], self.max_context - self.ctx[r])
        self.dec_turn[r] = self.dec_left[r]
        full = self.dec_left[r] < 1.0  # the context is full: the trajectory ends here
        self._finish(r[full], self.tool_end[r[full]])
        r = r[~full]
        self.phase[r] = WAIT
        self.ready_at[r] = self.tool_end[r]
        self.tool_end[r] = np.inf

    def _decode_workers(self) -> np.ndarray:
        return (self.w_role == W_ROLLOUT) | (self.w_role == W_DECODE)

    def _admit(self, now: float) -> int:
        """Route the requests waiting since ``now`` or earlier and give each a decode slot and a KV reservation
        on its worker; how many were admitted."""
        s = slice(self.lo, self.hi)
        ph = self.phase[s]
        q = np.flatnonzero((ph == WAIT) & (self.ready_at[s] <= now + 1e-9)) + self.lo
        if not q.size:
            return 0
        routable = self._decode_workers() & self.w_admit
        if not routable.any():
            return 0
        prof = self.profile
        n_w = len(self.w_role)
        running = np.flatnonzero((ph >= PREFILL) & (ph <= DECODE)) + self.lo
        rw = self.run_w[running]
        load = np.bincount(rw, minlength=n_w)
        slots = np.where(routable, prof.max_num_seqs - load, 0)
        # Admission counts only running reservations: tool-waiting KV is evictable (see _evict_for_capacity).
        free_kv = np.where(routable, prof.kv_capacity_tokens - np.bincount(rw, self.kv_hold[running], n_w), -1.0)
        need = self.ctx[q] + self.dec_left[q]
        if self.router == "balance":
            admitted_w = self._route_balance(q, routable, load, slots, free_kv, need)
        else:
            admitted_w = self._route_ring(q, routable, slots, free_kv, need)

        a = np.flatnonzero(admitted_w >= 0)
        if not a.size:
            return 0
        i, w = q[a], admitted_w[a]
        kv = self.kv_w[i]
        resident = (kv == w) | self.migrated[i]
        if self.free_migration and self.router == "consistent_hash":
            resident |= kv >= 0  # the oracle's world: a session's KV follows it wherever the ring sends it
        pf = np.where(resident, self.new_tok[i], self.ctx[i])
        recompute = pf - self.new_tok[i]
        self.stats["recompute_tokens"] += float(recompute.sum())
        left = self.orphaned[i] | ((kv >= 0) & ~routable[np.maximum(kv, 0)])
        self.stats["leave_recompute_tokens"] += float(recompute[left].sum())
        self.phase[i] = PREFILL
        self.run_w[i] = w
        self.kv_w[i] = w
        self.kv_hold[i] = need[a]
        self.pf_left[i] = pf
        self.pf_total[i] = pf
        self.migrated[i] = False
        self.orphaned[i] = False
        self.disp_w[i] = -1
        return int(a.size)

    def _route_balance(self, q, routable, load, slots, free_kv, need) -> np.ndarray:
        """The ``balance`` model (this simulator's before the run's router existed; no real router's rule):
        session affinity with load balance. A next turn goes back to the worker holding its KV unless that
        worker runs more than ``BALANCE_ABS`` sequences above the mean, in which case it goes elsewhere and
        re-prefills its context there; new prompts, and next turns whose KV is gone, go FIFO to the worker with
        the most free KV, and the first that fits nowhere blocks the queue behind it. A request waits in one
        queue until a worker admits it; running decodes never move. Returns each request's worker (-1: waits)."""
        n_w = len(self.w_role)
        admitted_w = np.full(q.size, -1, np.int32)
        slots, free_kv = slots.copy(), free_kv.copy()
        kw = self.kv_w[q]
        excess = np.where(routable, load - load[routable].mean(), 0.0)
        if (excess > BALANCE_ABS).any():
            moving = np.flatnonzero((kw >= 0) & (excess[np.maximum(kw, 0)] > BALANCE_ABS))
            if moving.size:
                moving = moving[np.lexsort((self.ready_at[q[moving]], kw[moving]))]
                w = kw[moving]
                rank = np.arange(w.size) - _group_starts(w)
                moving = moving[rank < excess[w] - BALANCE_ABS]
                self.kv_w[q[moving]] = -1
                self.kv_hold[q[moving]] = 0.0
                kw = self.kv_w[q]

        # Sequences whose KV is on a routable worker go back to it (session affinity), FIFO per worker.
        res = np.flatnonzero((kw >= 0) & routable[np.maximum(kw, 0)])
        if res.size:
            order = res[np.lexsort((self.ready_at[q[res]], kw[res]))]
            w = kw[order]
            ok = _fits(w, need[order], slots, free_kv)
            admitted_w[order[ok]] = w[ok]
            slots -= np.bincount(w[ok], minlength=n_w)
            free_kv -= np.bincount(w[ok], need[order[ok]], n_w)

        rest = np.flatnonzero(admitted_w < 0)
        rest = rest[np.argsort(self.ready_at[q[rest]], kind="stable")]
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

    def _route_ring(self, q, routable, slots, free_kv, need) -> np.ndarray:
        """vllm-router's ``consistent_hash`` policy, the one the run's router uses (pearlctl/router/service.py):
        a request goes to the worker its session hashes to on the ring of the routable workers (``VIRTUAL_NODES``
        virtual nodes each), whatever the loads, and queues there (vLLM's waiting queue, first come first
        served: the first that does not fit blocks the ones behind it) while that worker serves — even if the
        ring changes meanwhile. When a worker joins, the sessions that now hash to it move at their next turn
        and re-prefill there; when one leaves, its sessions go to the ring's next owners. Returns each
        request's worker (-1: it waits)."""
        d = self.disp_w[q]
        serving = self._decode_workers()
        target = np.where((d >= 0) & serving[np.maximum(d, 0)], d, self._ring_lookup(q, routable))
        self.disp_w[q] = target
        order = np.lexsort((self.ready_at[q], target))
        ok = _fits(target[order], need[order], slots, free_kv)
        admitted_w = np.full(q.size, -1, np.int32)
        admitted_w[order[ok]] = target[order[ok]]
        return admitted_w

    def _ring_lookup(self, i: np.ndarray, routable: np.ndarray) -> np.ndarray:
        """The worker each session of trajectories ``i`` hashes to on the ring of the ``routable`` workers."""
        key = routable.tobytes()
        if self._ring is None or self._ring[0] != key:
            workers = np.flatnonzero(routable)
            pos = self.vnodes[workers].ravel()
            owner = np.repeat(workers, VIRTUAL_NODES).astype(np.int32)
            by = np.argsort(pos)
            self._ring = (key, pos[by], owner[by])
        _, pos, owner = self._ring
        return owner[np.searchsorted(pos, self.session[i]) % pos.size]

    def _evict_for_capacity(self) -> None:
        """Evict the least recently used idle KV (tool-waiting or queued sequences) where a worker is over
        capacity; those sequences will re-prefill their whole context."""
        s = slice(self.lo, self.hi)
        kv_w = self.kv_w[s]
        held = kv_w >= 0
        if not held.any():
            return
        n_w = len(self.w_role)
        over = np.bincount(kv_w[held], self.kv_hold[s][held], n_w) - self.profile.kv_capacity_tokens
        if not (over > 0).any():
            return
        ph = self.phase[s]
        cand = np.flatnonzero(held & ((ph == TOOL) | (ph == WAIT)) & (over[np.maximum(kv_w, 0)] > 0)) + self.lo
        if not cand.size:
            return
        cand = cand[np.lexsort((self.tool_start[cand], self.kv_w[cand]))]
        w = self.kv_w[cand]
        group = _group_starts(w)
        cs = np.cumsum(self.kv_hold[cand])
        before = cs - self.kv_hold[cand] - _shift(cs)[group]
        ev = cand[before < over[w]]
        self.kv_w[ev] = -1
        self.kv_hold[ev] = 0.0
        self.stats["evictions"] += int(ev.size)

    def _prefill(self, t0: float, avail: float) -> np.ndarray:
        """Run the prefill queues for ``avail`` seconds from ``t0``; the seconds each worker spent on prefill."""
        n_w = len(self.w_role)
        p_time = np.zeros(n_w)
        s = slice(self.lo, self.hi)
        pf = np.flatnonzero(self.phase[s] == PREFILL) + self.lo
        if not pf.size:
            return p_time
        rate = self.profile.prefill_tok_s
        # The shared prefill FIFO runs on the routable PREFILL workers (a draining one takes nothing new).
        n_prefill = int(((self.w_role == W_PREFILL) & self.w_admit).sum())
        # A worker prefills its own sequences when it is colocated, or when no PREFILL worker exists.
        own = (self.w_role == W_ROLLOUT) | ((self.w_role == W_DECODE) & (n_prefill == 0))
        local = own[self.run_w[pf]]

        # Work is counted in profile-seconds x rate: under a mismatch a turn's tokens take ``prefill_scale`` times
        # as long as the profile says.
        loc = pf[local]
        if loc.size:
            loc = loc[np.lexsort((self.ready_at[loc], self.run_w[loc]))]
            w = self.run_w[loc]
            group = _group_starts(w)
            scale = self._prefill_scale(loc)
            need = self.pf_left[loc] if scale is None else self.pf_left[loc] * scale
            cs = np.cumsum(need)
            before = cs - need - _shift(cs)[group]
            work = np.clip(rate * avail - before, 0.0, need)
            tokens = work if scale is None else work / scale
            self.pf_left[loc] -= tokens
            self.stats["prefill_tokens"] += float(tokens.sum())
            p_time = np.bincount(w, work, n_w) / rate
            doneidx = loc[self.pf_left[loc] <= 1e-6]
            self.phase[doneidx] = DECODE
            self.new_tok[doneidx] = 0.0

        pool = pf[~local]
        if pool.size and n_prefill:
            pool = pool[np.argsort(self.ready_at[pool], kind="stable")]
            budget = rate * n_prefill * avail
            scale = self._prefill_scale(pool)
            need = self.pf_left[pool] if scale is None else self.pf_left[pool] * scale
            cs = np.cumsum(need)
            before = cs - need
            work = np.clip(budget - before, 0.0, need)
            tokens = work if scale is None else work / scale
            self.pf_left[pool] -= tokens
            self.stats["prefill_tokens"] += float(tokens.sum())
            fin = self.pf_left[pool] <= 1e-6
            doneidx = pool[fin]
            at = t0 + np.minimum(cs[fin] / budget, 1.0) * avail
            self.phase[doneidx] = XFER
            self.new_tok[doneidx] = 0.0
            self.xfer_end[doneidx] = at + self.profile.kv_transfer_s(self.pf_total[doneidx])
        return p_time

    def _decode(self, t0: float, avail: float, p_time: np.ndarray) -> None:
        s = slice(self.lo, self.hi)
        d = np.flatnonzero(self.phase[s] == DECODE) + self.lo
        if not d.size:
            return
        n_w = len(self.w_role)
        w = self.run_w[d]
        batch = np.bincount(w, minlength=n_w)
        ctx_sum = np.bincount(w, self.ctx[d], n_w)
        itl = np.full(n_w, np.inf)
        for k in np.flatnonzero(batch):
            # The planner's own decode model: sublinear in batch, MoE experts, the batch-1 straggler floor.
            itl[k] = self.profile.decode.itl(float(batch[k]), ctx_sum[k] / batch[k])
        decode_time = np.maximum(avail - p_time, 0.0)
        iters = decode_time / itl
        left = self.dec_left[d]
        # Under a mismatch a turn's tokens each take ``decode_scale`` of its worker's iterations.
        scale = None if self.draws.decode_scale is None else self.draws.decode_scale[d, self.turn[d]]
        adv = np.minimum(left, iters[w] if scale is None else iters[w] / scale)
        self.ctx[d] += adv
        self.dec_left[d] = left - adv
        self.stats["decode_tokens"] += float(adv.sum())
        fin = left - adv <= 1e-6
        if not fin.any():
            return
        i = d[fin]
        end = t0 + p_time[w[fin]] + left[fin] * itl[w[fin]] * (1.0 if scale is None else scale[fin])
        last = (self.turn[i] + 1 >= self.draws.turns[i]) | (self.ctx[i] >= self.max_context - 1)
        self._finish(i[last], end[last])
        i, end = i[~last], end[~last]
        self.phase[i] = TOOL
        self.run_w[i] = -1
        self.kv_hold[i] = self.ctx[i]  # the reservation shrinks to the context it keeps
        self.tool_start[i] = end
        self.tool_end[i] = end + self.draws.tool_latency[i, self.turn[i]]

    def _prefill_scale(self, i: np.ndarray) -> np.ndarray | None:
        """How much longer than the profile says trajectories ``i`` take to prefill this turn (None: as it says)."""
        s = self.draws.prefill_scale
        return None if s is None else s[i, np.minimum(self.turn[i], s.shape[1] - 1)]

    def _finish(self, i: np.ndarray, at) -> None:
        self.phase[i] = DONE
        self.done_at[i] = at
        self.run_w[i] = -1
        self.kv_w[i] = -1
        self.kv_hold[i] = 0.0

    # -- what the run loop reads --------------------------------------------------------------------

    def all_done(self, lo: int, hi: int) -> bool:
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

    def busy(self) -> bool:
        """Some launched trajectory is unfinished (``in_flight`` is not empty)."""
        ph = self.phase[self.lo : self.hi]
        return bool(((ph != DONE) & (ph != PENDING)).any())

    def in_flight(self) -> np.ndarray:
        """Indices of launched, unfinished trajectories."""
        s = slice(self.lo, self.hi)
        return np.flatnonzero((self.phase[s] != DONE) & (self.phase[s] != PENDING)) + self.lo


def _fits(w: np.ndarray, need: np.ndarray, slots: np.ndarray, free_kv: np.ndarray) -> np.ndarray:
    """For requests sorted by worker ``w`` (FIFO within each), which are admitted: first come first served
    per worker, as far as its free slots and KV go (a request that does not fit blocks those behind it)."""
    group = _group_starts(w)
    cs = np.cumsum(need)
    cs_group = cs - _shift(cs)[group]
    rank = np.arange(w.size) - group
    return (rank < slots[w]) & (cs_group <= free_kv[w])


def _group_starts(keys: np.ndarray) -> np.ndarray:
    """For sorted ``keys``, the index where each element's group (run of equal keys) starts."""
    starts = np.flatnonzero(np.diff(keys)) + 1
    first = np.zeros(keys.size, np.int64)
    first[starts] = starts
    return np.maximum.accumulate(first)


def _shift(cs: np.ndarray) -> np.ndarray:
    """``cs`` with a 0 in front: ``_shift(cs)[g]`` is the running total before position ``g``."""
    return np.concatenate(([0.0], cs))
