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

Speed, not model: a tick works only on the window of trajectories in flight (``Engine.lo`` .. ``Engine.hi``:
launched and not all done) and skips what has nothing to do; the ``Engine`` doc lists the shortcuts, each of
which leaves every result bit for bit as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pearlctl.planner.profile import DecodeModel, Profile
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
    """Trajectories and workers of one simulated run. ``launch`` a batch, set the worker roles, ``step``.

    Speed (every tick of every run comes here; none of this changes a result, bit for bit):

    - The window: each tick works on trajectories ``[lo, hi)``; those before ``lo`` are all DONE (``lo`` moves
      when one finishes), those from ``hi`` on PENDING.
    - Skips: arrivals before the earliest pending tool return or KV transfer (``_next_tool``, ``_next_xfer``:
      lower bounds, exact after each scan); admission when nothing changed since a call that admitted nothing
      (``_admit_dirty``: the consistent-hash admission is a pure function of the waiting requests, the running
      reservations and the roles) and no waiting request becomes ready (``_admit_wake``), or when none is
      queued and none arrived; prefill when no sequence prefills (``_prefilling``).
    - The consistent-hash queue persists (``_queue``, in the order a sort of all waiting requests would give):
      a request is routed and put in its place once, when it becomes ready; it is rebuilt when roles change.
    - Invariants the scans rely on: ``run_w >= 0`` exactly while a sequence runs (PREFILL, XFER, DECODE);
      ``tool_end`` is finite exactly in TOOL, ``xfer_end`` exactly in XFER.
    - Few events (up to ``_FEW`` arrivals, admissions, turn ends, colocated prefills in a tick) are handled
      element by element (``*_few``), where numpy's cost per call would dominate; the same arithmetic in the
      same order.
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
        if router not in ROUTERS:
            raise ValueError(f"no router model {router!r}; known: {', '.join(ROUTERS)}")
        self.router = router
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
        # The router's hash ring: each session's hash and each worker's virtual nodes, fixed for the run (the
        # same for every policy); the ring of the routable workers is rebuilt when they change.
        self.session = np.random.default_rng(0x5E55).random(n)
        self.vnodes = np.random.default_rng(0x21A6).random((n_workers, VIRTUAL_NODES))
        self._ring: tuple[bytes, np.ndarray, np.ndarray] | None = None
        self._ring_at: tuple[bytes, int, int, np.ndarray] | None = None  # the ring's worker for trajectories lo..hi
        self.pause_until = 0.0
        self.lo = 0  # trajectories before lo are all DONE; those from hi on are PENDING
        self.hi = 0
        # What a tick may skip (the class doc).
        self._next_tool = np.inf
        self._next_xfer = np.inf
        self._admit_dirty = True
        self._admit_wake = np.inf
        self._prefilling = False  # some sequence may be in PREFILL
        # consistent_hash: the routed waiting requests, kept in the order the queues serve them (their worker,
        # then ready_at, then index) from one admission to the next (rebuilt when the roles change)
        self._queue = np.zeros(0, np.intp)
        self._queue_ok = False
        self._queued = np.zeros(n, bool)
        self._arrived: list[np.ndarray] = []  # requests that became ready since the last admission (arrivals)
        self._need = np.zeros(n)  # a queued request's KV reservation (context + the turn's response)
        self._itl = _vector_itl(profile.decode)
        self._itl_by_batch: tuple[np.ndarray, np.ndarray] | None = None  # (_decode_itl's tables)
        # The mismatch factors of each trajectory's current turn (kept as its turn advances).
        ds, ps = draws.decode_scale, draws.prefill_scale
        self._dscale = None if ds is None else ds[:, 0].copy()
        self._pscale = None if ps is None else ps[:, 0].copy()
        self._finished = False  # some trajectory finished this tick: the window's lo may move
        self.w_role = np.zeros(n_workers, np.int8)
        self.w_admit = np.ones(n_workers, bool)  # routable: takes new requests (false: draining)
        self._roles_changed()
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
        self._admit_dirty = True
        self._queue_ok = False
        self._arrived = []
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
            self._evict_workers(changed, t, hard)
        self.w_role = roles.copy()
        self.w_admit = np.ones(len(roles), bool) if routable is None else np.asarray(routable, bool).copy()
        self._roles_changed()

    def _roles_changed(self) -> None:
        """What the tick reads of the roles, kept until they change."""
        roles = self.w_role
        self._serving = bool((roles != W_OFF).any())
        self._decode_w = (roles == W_ROLLOUT) | (roles == W_DECODE)
        self._routable = self._decode_w & self.w_admit
        self._any_routable = bool(self._routable.any())
        self._n_prefill = int(((roles == W_PREFILL) & self.w_admit).sum())
        # A worker prefills its own sequences when it is colocated, or when no PREFILL worker exists.
        self._own = (roles == W_ROLLOUT) | ((roles == W_DECODE) & (self._n_prefill == 0))
        self._admit_dirty = True
        self._queue_ok = False  # routes and rings may change
        self._arrived = []
        if self._ring_at is not None and self._ring_at[0] != self._routable.tobytes():
            self._ring_at = None

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
        self.xfer_end[idx] = np.inf  # a KV transfer in flight is lost with its worker
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
        self._admit_wake = min(self._admit_wake, t + ABORT_S)
        self.orphaned[held] = True
        self.kv_w[held] = -1
        self.kv_hold[held] = 0.0

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
            p_time = self._prefill(t + start, avail) if self._prefilling else np.zeros(len(self.w_role))
            self._decode(t + start, avail, p_time)
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
        if r.size <= _FEW:
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
        if self._dscale is not None:
            self._dscale[r] = d.decode_scale[r, k]
        if self._pscale is not None:
            self._pscale[r] = d.prefill_scale[r, np.minimum(k, d.prefill_scale.shape[1] - 1)]
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
            if self.router == "consistent_hash":
                self._arrived.append(r)

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
            if self._dscale is not None:
                self._dscale[i] = d.decode_scale[i, k]
            if self._pscale is not None:
                self._pscale[i] = d.prefill_scale[i, min(k, last)]
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
            if self.router == "consistent_hash":
                self._arrived.append(np.array(waiting, np.intp))

    def _admit(self, now: float) -> int:
        """Route the requests waiting since ``now`` or earlier and give each a decode slot and a KV reservation
        on its worker; how many were admitted."""
        if not self._any_routable:
            return 0
        ring = self.router == "consistent_hash"
        if ring and not self._admit_dirty and now + 1e-9 < self._admit_wake:
            return 0  # nothing changed since a call that admitted nothing: it would admit nothing again
        self._admit_dirty = False
        s = slice(self.lo, self.hi)
        if ring and self._queue_ok and now + 1e-9 < self._admit_wake:
            ready = None  # the requests that became ready since the last admission are the arrivals'
            if not self._arrived and not self._queue.size:
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
            i, w, need = self._route_ring(ready, routable, slots, free_kv)
            if not i.size:
                return 0
        else:
            q = ready.nonzero()[0]
            if not q.size:
                return 0
            q += self.lo
            need = self.ctx[q] + self.dec_left[q]
            admitted_w = self._route_balance(q, routable, load, slots, free_kv, need)
            a = (admitted_w >= 0).nonzero()[0]
            if not a.size:
                return 0
            i, w, need = q[a], admitted_w[a], need[a]

        self._admit_dirty = True
        self._prefilling = True
        if i.size <= _FEW:
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

    def _route_balance(self, q, routable, load, slots, free_kv, need) -> np.ndarray:
        """The ``balance`` model (this simulator's before the run's router existed; no real router's rule):
        session affinity with load balance. A next turn goes back to the worker holding its KV unless that
        worker runs more than ``BALANCE_ABS`` sequences above the mean, in which case it goes elsewhere and
        re-prefills its context there; new prompts, and next turns whose KV is gone, go FIFO to the worker with
        the most free KV, and the first that fits nowhere blocks the queue behind it. A request waits in one
        queue until a worker admits it; running decodes never move. Returns each request's worker (-1: waits)."""
        n_w = len(self.w_role)
        admitted_w = np.full(q.size, -1, np.intp)
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

    def _route_ring(self, ready: np.ndarray, routable, slots, free_kv) -> tuple[np.ndarray, ...]:
        """vllm-router's ``consistent_hash`` policy, the one the run's router uses (pearlctl/router/service.py):
        a request goes to the worker its session hashes to on the ring of the routable workers (``VIRTUAL_NODES``
        virtual nodes each), whatever the loads, and queues there (vLLM's waiting queue, first come first
        served: the first that does not fit blocks the ones behind it) while that worker serves — even if the
        ring changes meanwhile. When a worker joins, the sessions that now hash to it move at their next turn
        and re-prefill there; when one leaves, its sessions go to the ring's next owners. ``ready``: the window's
        ready waiting requests (a mask; None: those queued and the arrivals since). Returns the admitted requests
        (in index order), their workers and needs.

        The routed queue (``_queue``) persists between admissions: a request is routed once, when it becomes
        ready, and put in its place (by worker, ready_at, index: the order a sort of all of them would give)."""
        if ready is None:
            new = self._arrived[0] if len(self._arrived) == 1 else np.concatenate(self._arrived or [self._queue[:0]])
        elif self._queue_ok:
            new = (ready & ~self._queued[self.lo : self.hi]).nonzero()[0] + self.lo
        else:  # route every ready request again
            self._queued[self._queue] = False
            self._queue = self._queue[:0]
            self._queue_ok = True
            new = ready.nonzero()[0] + self.lo
        self._arrived = []
        if new.size:
            d = self.disp_w[new]
            if d.max() < 0:
                target = self._ring_lookup(new)
            else:
                target = np.where((d >= 0) & self._decode_w[np.maximum(d, 0)], d, self._ring_lookup(new))
            self.disp_w[new] = target
            self._need[new] = self.ctx[new] + self.dec_left[new]
            self._queued[new] = True
            if new.size > 1:
                by = np.lexsort((self.ready_at[new], target))
                new, target = new[by], target[by]
            self._enqueue(new, target)
        queue = self._queue
        if not queue.size:
            return queue, queue, queue
        w = self.disp_w[queue]
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

    def _enqueue(self, new: np.ndarray, target: np.ndarray) -> None:
        """Put routed requests ``new`` (sorted by ``target``, then ready_at, then index) in their places in the
        queue: at the end of their worker's queue when they became ready after all of it (the usual case), else
        by sorting the whole queue again."""
        queue = self._queue
        if not queue.size:
            self._queue = new
            return
        w = self.disp_w[queue]
        end = w.searchsorted(target, side="right")
        if new.size <= _FEW:
            ready_at = self.ready_at
            after = all(
                e == 0 or w.item(e - 1) != k or ready_at.item(queue.item(e - 1)) < ready_at.item(j)
                for e, k, j in zip(end.tolist(), target.tolist(), new.tolist(), strict=True)
            )
        else:
            last = queue[np.maximum(end - 1, 0)]
            after = (end == 0) | (w[np.maximum(end - 1, 0)] != target) | (self.ready_at[last] < self.ready_at[new])
            after = after.all()
        if not after:
            both = np.concatenate((queue, new))
            self._queue = both[np.lexsort((both, self.ready_at[both], self.disp_w[both]))]
            return
        pos = end + np.arange(new.size)
        merged = np.empty(queue.size + new.size, queue.dtype)
        merged[pos] = new
        old = np.empty(merged.size, bool)
        old.fill(True)
        old[pos] = False
        merged[old] = queue
        self._queue = merged

    def _ring_lookup(self, i: np.ndarray) -> np.ndarray:
        """The worker each session of trajectories ``i`` (in the window) hashes to on the ring of the routable
        workers (looked up for the whole window at once, once per ring and window)."""
        at = self._ring_at
        if at is None or at[1] > self.lo or at[2] < self.hi:
            routable = self._routable
            key = routable.tobytes()
            if self._ring is None or self._ring[0] != key:
                workers = np.flatnonzero(routable)
                pos = self.vnodes[workers].ravel()
                owner = np.repeat(workers, VIRTUAL_NODES)
                by = np.argsort(pos)
                self._ring = (key, pos[by], owner[by])
            _, pos, owner = self._ring
            at = (key, self.lo, self.hi, owner[pos.searchsorted(self.session[self.lo : self.hi]) % pos.size])
            self._ring_at = at
        return at[3][i - at[1]]

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
        before = cs[1:] - hold - cs[_group_starts(w)]
        ev = cand[before < over[w]]
        self.kv_w[ev] = -1
        self.kv_hold[ev] = 0.0
        self.stats["evictions"] += int(ev.size)

    def _prefill(self, t0: float, avail: float) -> np.ndarray:
        """Run the prefill queues for ``avail`` seconds from ``t0``; the seconds each worker spent on prefill."""
        n_w = len(self.w_role)
        p_time = np.zeros(n_w)
        s = slice(self.lo, self.hi)
        pf = (self.phase[s] == PREFILL).nonzero()[0]
        if not pf.size:
            self._prefilling = False
            return p_time
        pf += self.lo
        left = pf.size
        rate = self.profile.prefill_tok_s
        # The shared prefill FIFO runs on the routable PREFILL workers (a draining one takes nothing new).
        n_prefill = self._n_prefill
        pw = self.run_w[pf]
        local = self._own[pw]

        # Work is counted in profile-seconds x rate: under a mismatch a turn's tokens take ``prefill_scale`` times
        # as long as the profile says.
        loc = pf[local]
        if 0 < loc.size <= _FEW:
            p_time, done = self._prefill_few(loc, pw[local], rate * avail, n_w)
            left -= done
        elif loc.size:
            w = pw[local]
            by = np.lexsort((self.ready_at[loc], w))
            loc, w = loc[by], w[by]
            scale = self._prefill_scale(loc)
            pf_left = self.pf_left[loc]
            need = pf_left if scale is None else pf_left * scale
            cs = np.zeros(loc.size + 1)
            np.add.accumulate(need, out=cs[1:])
            before = cs[1:] - need - cs[_group_starts(w)]
            work = np.minimum(np.maximum(rate * avail - before, 0.0), need)
            tokens = work if scale is None else work / scale
            pf_left = pf_left - tokens
            self.pf_left[loc] = pf_left
            self.stats["prefill_tokens"] += float(tokens.sum())
            p_time = np.bincount(w, work, n_w) / rate
            fin = pf_left <= 1e-6
            doneidx = loc[fin]
            self.phase[doneidx] = DECODE
            self.new_tok[doneidx] = 0.0
            left -= doneidx.size

        pool = pf[~local] if loc.size < pf.size else pf[:0]
        if pool.size and n_prefill:
            pool = pool[self.ready_at[pool].argsort(kind="stable")]
            budget = rate * n_prefill * avail
            scale = self._prefill_scale(pool)
            pf_left = self.pf_left[pool]
            need = pf_left if scale is None else pf_left * scale
            cs = need.cumsum()
            before = cs - need
            work = np.minimum(np.maximum(budget - before, 0.0), need)
            tokens = work if scale is None else work / scale
            pf_left = pf_left - tokens
            self.pf_left[pool] = pf_left
            self.stats["prefill_tokens"] += float(tokens.sum())
            fin = pf_left <= 1e-6
            doneidx = pool[fin]
            if doneidx.size:
                at = t0 + np.minimum(cs[fin] / budget, 1.0) * avail
                self.phase[doneidx] = XFER
                self.new_tok[doneidx] = 0.0
                xfer_end = at + self.profile.kv_transfer_s(self.pf_total[doneidx])
                self.xfer_end[doneidx] = xfer_end
                self._next_xfer = min(self._next_xfer, float(xfer_end.min()))
                left -= doneidx.size
        self._prefilling = left > 0
        return p_time

    def _prefill_few(self, loc: np.ndarray, w: np.ndarray, budget: float, n_w: int) -> tuple[np.ndarray, int]:
        """``_prefill``'s colocated queues for a few sequences, element by element (the same arithmetic in the same
        order as its vector form): each worker prefills its own FIFO for ``budget`` profile-token-seconds. The
        seconds each worker spent and how many sequences finished."""
        rate = self.profile.prefill_tok_s
        at, ws, ready = loc.tolist(), w.tolist(), self.ready_at[loc].tolist()
        left = self.pf_left[loc].tolist()
        scale = self._prefill_scale(loc)
        scales = None if scale is None else scale.tolist()
        spent: dict[int, float] = {}
        tokens = []
        cs = base = 0.0  # the running total of the work asked, and where this worker's queue started in it
        cur = -1
        done = 0
        for j in sorted(range(len(at)), key=lambda j: (ws[j], ready[j])):
            k = ws[j]
            if k != cur:
                cur, base = k, cs
            need = left[j] if scales is None else left[j] * scales[j]
            cs += need
            work = min(max(budget - (cs - need - base), 0.0), need)
            tok = work if scales is None else work / scales[j]
            tokens.append(tok)
            spent[k] = spent.get(k, 0.0) + work
            i = at[j]
            rest = left[j] - tok
            self.pf_left[i] = rest
            if rest <= 1e-6:
                self.phase[i] = DECODE
                self.new_tok[i] = 0.0
                done += 1
        self.stats["prefill_tokens"] += float(np.add.reduce(np.array(tokens)))
        p_time = np.zeros(n_w)
        for k, x in spent.items():
            p_time[k] = x / rate
        return p_time, done

    def _decode(self, t0: float, avail: float, p_time: np.ndarray) -> None:
        s = slice(self.lo, self.hi)
        d = (self.phase[s] == DECODE).nonzero()[0]
        if not d.size:
            return
        d += self.lo
        n_w = len(self.w_role)
        w = self.run_w[d]
        batch = np.bincount(w, minlength=n_w)
        ctx = self.ctx[d]
        ctx_sum = np.bincount(w, ctx, n_w)
        # The planner's own decode model: sublinear in batch, MoE experts, the batch-1 straggler floor.
        itl = self._decode_itl(batch, ctx_sum)
        decode_time = np.maximum(avail - p_time, 0.0)
        iters = (decode_time / itl)[w]
        left = self.dec_left[d]
        # Under a mismatch a turn's tokens each take ``decode_scale`` of its worker's iterations.
        scale = None if self._dscale is None else self._dscale[d]
        adv = np.minimum(left, iters if scale is None else iters / scale)
        ctx = ctx + adv
        self.ctx[d] = ctx
        rest = left - adv
        self.dec_left[d] = rest
        self.stats["decode_tokens"] += float(np.add.reduce(adv))
        fin = rest <= 1e-6
        done = np.count_nonzero(fin)
        if not done:
            return
        self._admit_dirty = True  # slots and KV reservations free up
        if done <= _FEW:
            self._decoded_few(d, fin, w, left, ctx, itl, t0, p_time, scale)
            return
        i = d[fin]
        wf = w[fin]
        took = left[fin] * itl[wf]
        end = t0 + p_time[wf] + (took if scale is None else took * scale[fin])
        turn = self.turn[i]
        last = (turn + 1 >= self.draws.turns[i]) | (ctx[fin] >= self.max_context - 1)
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

    def _decoded_few(self, d, fin, w, left, ctx, itl, t0: float, p_time, scale) -> None:
        """``_decode``'s turn ends for a few sequences, element by element (the same arithmetic): each ends its
        trajectory or starts its tool call."""
        draws = self.draws
        top = self.max_context - 1
        for j in fin.nonzero()[0].tolist():
            i, k = d.item(j), w.item(j)
            took = left.item(j) * itl.item(k)
            end = t0 + p_time.item(k) + (took if scale is None else took * scale.item(j))
            turn = self.turn.item(i)
            c = ctx.item(j)
            if turn + 1 >= draws.turns.item(i) or c >= top:
                self._finish_one(i, end)
                continue
            self.phase[i] = TOOL
            self.run_w[i] = -1
            self.kv_hold[i] = c  # the reservation shrinks to the context it keeps
            self.tool_start[i] = end
            tool_end = end + draws.tool_latency.item(i, turn)
            self.tool_end[i] = tool_end
            self._next_tool = min(self._next_tool, tool_end)

    def _decode_itl(self, batch: np.ndarray, ctx_sum: np.ndarray) -> np.ndarray:
        """Each worker's decode iteration, ``profile.decode.itl(batch, mean context)`` (inf: no batch)."""
        if self._itl is None:  # a decode model of its own: asked worker by worker
            itl_of = self.profile.decode.itl
            bc = zip(batch.tolist(), ctx_sum.tolist(), strict=True)
            return np.array([itl_of(float(b), c / b) if b else np.inf for b, c in bc])
        if self._itl_by_batch is None:  # (a batch is at most max_num_seqs)
            self._itl_by_batch = self._itl(max(self.profile.max_num_seqs, 1))
        fixed, per_ctx = self._itl_by_batch
        try:
            fixed, per_ctx = fixed[batch], per_ctx[batch]
        except IndexError:  # a batch above max_num_seqs
            self._itl_by_batch = fixed, per_ctx = self._itl(int(batch.max()))
            fixed, per_ctx = fixed[batch], per_ctx[batch]
        return fixed + per_ctx * np.maximum(ctx_sum / np.maximum(batch, 1), 0.0)

    def _prefill_scale(self, i: np.ndarray) -> np.ndarray | None:
        """How much longer than the profile says trajectories ``i`` take to prefill this turn (None: as it says)."""
        return None if self._pscale is None else self._pscale[i]

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


# Up to this many sequences, a step's bookkeeping runs element by element (numpy's per-call cost dominates).
_FEW = 16


def _fits(w: np.ndarray, need: np.ndarray, slots: np.ndarray, free_kv: np.ndarray) -> np.ndarray:
    """For requests sorted by worker ``w`` (FIFO within each), which are admitted: first come first served
    per worker, as far as its free slots and KV go (a request that does not fit blocks those behind it)."""
    start = _group_starts(w)  # where each request's worker's requests start
    cs = np.zeros(w.size + 1)  # cs[g]: the running total before position g
    np.add.accumulate(need, out=cs[1:])
    # rank within the worker's queue < its free slots; the running total of its queue (as a difference of
    # the running totals of the whole queue) within its free KV
    return (np.arange(w.size) < start + slots[w]) & (cs[1:] - cs[start] <= free_kv[w])


def _group_starts(keys: np.ndarray) -> np.ndarray:
    """For sorted ``keys``, the index where each element's group (run of equal keys) starts."""
    return keys.searchsorted(keys)


def _vector_itl(decode):
    """``DecodeModel.itl`` by batch size, for the engine's arrays of workers: a function of the largest batch
    ``top`` giving two tables over batch sizes ``b`` = 0 .. top, ``fixed`` and ``per_ctx``, such that ``fixed[b] +
    per_ctx[b] * max(c, 0)`` is ``itl(b, c)`` bit for bit (the same operations in the same order: ``fixed`` holds
    the sum of the terms before the context's, ``per_ctx`` the factor of ``max(c, 0)``), and inf for b = 0 (no
    batch). None when the decode model is not one this matches (the engine then asks ``itl`` worker by worker)."""
    if type(decode) is not DecodeModel:
        return None
    ws, es, ss, ks = decode.weights_s, decode.experts_s, decode.seq_s, decode.kv_s_per_token

    def tables(top: int) -> tuple[np.ndarray, np.ndarray]:
        b = np.arange(top + 1)
        if decode.moe_experts:
            e = np.array([decode.distinct_experts(float(x)) for x in range(top + 1)])
            fixed = ws + es * e + ss * b
        else:
            fixed = ws + ss * b  # ws + es * 0.0 is ws
        fixed[0] = np.inf  # (inf + 0.0 * 0.0: a worker with no batch, mean context 0 / 1)
        return fixed, ks * b

    # A check that DecodeModel.itl is still this formula.
    fixed, per_ctx = tables(255)
    b = np.array([1, 2, 7, 64, 255])
    c = np.array([0.0, 1234.5, 40000.25, 3.0e3 / 7.0, 9.99e4 / 3.0])
    if (fixed[b] + per_ctx[b] * np.maximum(c, 0.0)).tolist() != [
        decode.itl(float(x), y) for x, y in zip(b.tolist(), c.tolist(), strict=True)
    ]:
        return None
    return tables
