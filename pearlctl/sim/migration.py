"""The simulated engines' migrations: what becomes of the sequences on a worker that leaves its serving role, and of
the queues the gateway rebalances when workers join (``leave`` and ``rebalance``, on a
``pearlctl.sim.engine.Engine`` when its roles change).

- **Migration is abort and continue**, as the live system does it when a worker leaves (the run's gateway,
  pearlctl/router/gateway.py, continues an aborted turn on another worker from its token ids). A worker that
  leaves loses its KV. On a *graceful* leave its running sequences are continued on another worker with every
  token they generated, ``ABORT_S`` later, and re-prefill that whole context there; on a *hard kill* the running
  turn is retried from its start and the tokens it generated are lost (``lost_tokens``). Requests queued at a
  leaving worker are sent again through the router; tool-waiting sequences whose KV it held re-prefill their
  context on their next turn (``orphaned``).
- **A join rebalances queues and imbalanced workers, as the gateway does** (pearlctl/router/admin.py): each older
  colocated worker with requests waiting in its queue, or whose load (sequences running and waiting) is
  imbalanced against the idlest routable worker's (``pearlctl.vocabulary.imbalanced``, vllm-router's own test),
  has what it decodes and what waits there sent again ``ABORT_S`` later; the sessions that now hash to a joined
  worker go there and re-prefill, the others return to their worker, whose prefix cache holds their context.
- ``free_migration`` (the oracle's world): sequences and their KV move at once; nothing is aborted or lost.

Guarantees: each function reads and writes of the engine only what ``MigratingEngine`` lists, and tells the engine
when the requests it sent again become ready (the engine keeps its own admission shortcuts); the same arithmetic in
the same order as when these were the engine's own methods, so results are unchanged bit for bit.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pearlctl.sim.routing import RoutedEngine, Router
from pearlctl.sim.trajectories import DECODE, PREFILL, WAIT
from pearlctl.vocabulary import imbalanced

# ASSUMPTION (not measured): from a leave to its sequences' continuation on another worker — the
# deregistration reaching the router (a daemon tick, 0.5 s), the abort and its answers, the new requests.
# A leaving GPU starts its own transition (sleep, stop, switch) only after it too.
ABORT_S = 1.0


class MigratingEngine(RoutedEngine, Protocol):
    """What a migration reads and writes of its engine (``pearlctl.sim.engine.Engine``), beyond what its router
    reads (``RoutedEngine``): the router itself, the trajectories' phases and the arrays a leave or a rebalance
    resets, the oracle's world (``free_migration``) and the counters."""

    router: Router
    free_migration: bool
    phase: np.ndarray
    run_w: np.ndarray
    new_tok: np.ndarray
    dec_turn: np.ndarray
    xfer_end: np.ndarray
    migrated: np.ndarray
    orphaned: np.ndarray
    stats: dict[str, float]


def leave(e: MigratingEngine, workers: np.ndarray, t: float, hard: np.ndarray) -> float:
    """``workers`` leave their serving role at ``t`` (those in ``hard``, a boolean mask over workers: hard-killed):
    their running and queued sequences wait to be sent again and the KV they held is gone (the module doc). Returns
    when those sent again become ready (``inf``: nothing waits for an abort, the oracle's world)."""
    s = slice(e.lo, e.hi)
    gone = np.zeros(len(e.w_role), bool)
    gone[workers] = True
    ph, run_w, kv_w = e.phase[s], e.run_w[s], e.kv_w[s]
    running = (ph >= PREFILL) & (ph <= DECODE) & (run_w >= 0)
    running &= gone[np.maximum(run_w, 0)]
    holding = (kv_w >= 0) & gone[np.maximum(kv_w, 0)]
    idx = np.flatnonzero(running) + e.lo
    held = np.flatnonzero(holding) + e.lo
    # requests queued at a leaving worker are aborted too (nothing generated): sent again through the router
    queued = np.flatnonzero((ph == WAIT) & (e.disp_w[s] >= 0) & gone[np.maximum(e.disp_w[s], 0)])
    queued += e.lo
    e.disp_w[queued] = -1
    e.stats["requeued"] += int(idx.size)
    e.xfer_end[idx] = np.inf  # a KV transfer in flight is lost with its worker
    if e.free_migration:
        # The oracle's world: the sequences and their KV move at once; nothing is aborted or lost.
        e.phase[idx] = WAIT
        e.run_w[idx] = -1
        e.migrated[held] = True
        e.kv_w[held] = -1
        e.kv_hold[held] = 0.0
        return np.inf
    # Hard kill: the turn is retried from its start (its generated tokens are lost; a sequence still in
    # prefill or in a KV transfer has generated none). Graceful: the continuation keeps them all (ctx).
    killed = idx[hard[e.run_w[idx]]]
    if killed.size:
        lost = e.dec_turn[killed] - e.dec_left[killed]
        e.ctx[killed] -= lost
        e.dec_left[killed] = e.dec_turn[killed]
        e.stats["lost_tokens"] += float(lost.sum())
    e.stats["killed"] += int(killed.size)
    e.stats["aborted"] += int(idx.size - killed.size)
    # A sequence whose prefill had not finished still owes its new tokens; the rest is re-prefilled too.
    e.phase[idx] = WAIT
    e.run_w[idx] = -1
    e.ready_at[idx] = t + ABORT_S  # a new request, behind those already waiting
    e.ready_at[queued] = np.maximum(e.ready_at[queued], t + ABORT_S)
    e.orphaned[held] = True
    e.kv_w[held] = -1
    e.kv_hold[held] = 0.0
    return t + ABORT_S


def rebalance(e: MigratingEngine, old: np.ndarray, t: float, routable: np.ndarray) -> float:
    """Workers joined the ring of the ``routable`` workers (the gateway's rebalance, pearlctl/router/admin.py): the
    ``old`` colocated workers with a queue, or imbalanced against the idlest routable worker, abort what they decode
    and what waits in their queues, and the gateway sends it all again through the router, ``ABORT_S`` later, on
    the new ring. A session that now hashes to a joined worker goes there and re-prefills its context (a decode
    with every token it generated); the others go back to their worker, where vLLM's prefix cache holds their
    context (nothing to prefill), behind what was already waiting there. A sequence in prefill keeps its place (its
    computed blocks are cached either way). Returns when those sent again become ready (``inf``: nothing was sent
    again)."""
    s = slice(e.lo, e.hi)
    ph, run_w, disp_w = e.phase[s], e.run_w[s], e.disp_w[s]
    at_queue = (ph == WAIT) & (disp_w >= 0)
    running = (ph >= PREFILL) & (ph <= DECODE) & (run_w >= 0)
    waiting = np.bincount(disp_w[at_queue], minlength=len(old))
    load = waiting + np.bincount(run_w[running], minlength=len(old))
    old = old & ((waiting > 0) | imbalanced(load, load[routable].min()))  # a queue, or far busier than the idlest
    if not old.any():
        return np.inf
    decoding = (ph == DECODE) & old[np.maximum(run_w, 0)] & (run_w >= 0)
    queued = at_queue & old[np.maximum(disp_w, 0)]
    i = np.flatnonzero(decoding | queued) + e.lo
    if not i.size:
        return np.inf
    run = e.run_w[i]
    dec = run >= 0
    owner = e.router.ring_owner(e, i, routable)
    moves = i[dec & (owner != run)]
    stays = i[dec & (owner == run)]
    e.stats["rebalanced"] += int(np.count_nonzero(dec))
    e.stats["moved"] += int(moves.size)
    if not e.free_migration:  # the oracle's world: a session's KV follows it (``Engine._admit``)
        e.orphaned[moves] = True
        e.kv_w[moves] = -1
    e.kv_hold[i[dec]] = 0.0
    e.new_tok[stays] = 0  # in the prefix cache
    e.phase[i[dec]] = WAIT
    e.run_w[i] = -1
    e.disp_w[i] = -1
    again = t if e.free_migration else t + ABORT_S
    e.ready_at[i] = np.maximum(e.ready_at[i], again)
    return again
